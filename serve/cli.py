"""`python -m dspark_jax.serve`: serve a target (with a DSpark drafter) behind an OpenAI-compatible HTTP API.

Loads the engine (`serve.startup.create_engine`): it answers once the programs of one request are compiled,
then compiles its other capacity buckets and profiles the SPS table while idle (`--startup blocking` does all
of it first), and serves /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics
until Ctrl-C. If the engine loop dies, the process exits with status 70 (the engine's `exit_on_fatal`, and a
watchdog here): a supervisor restarts it, rather than a live process answering 503 forever. Example:

    python -m dspark_jax.serve --max-batch 32 --port 8000
    curl localhost:8000/v1/chat/completions -H 'content-type: application/json' \\
      -d '{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi!"}]}'
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading

SCHEDULERS = "none, fixed:N, threshold:X, dspark-sync, dspark"
KERNELS = ("auto", "reference", "pallas")
DTYPES = ("auto", "float32", "bfloat16")  # = dspark_jax.target.DTYPE_CHOICES (not imported here: it pulls in JAX)
LOG_LEVELS = ("debug", "info", "warning", "error")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """Bad flags: one `error:` line on stderr and exit 2 (argparse would add the usage first)."""
        self.exit(2, f"error: {message}\n")


def scheduler_spec(value: str) -> str:
    """Validates a --scheduler value with the one policy parser (dspark_jax/policy.py, no JAX); returns it."""
    from dspark_jax.policy import Policy

    try:
        Policy.parse(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value!r}")
    return n


def _positive_float(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        x = 0.0
    if not x > 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value!r}")
    return x


def _port(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = -1
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {value!r}")
    return n


def parse_args(argv=None) -> argparse.Namespace:
    p = _Parser(prog="python -m dspark_jax.serve", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct",
                   help="target model: a known name, a Hugging Face directory or a .gguf file (default: %(default)s)")
    p.add_argument("--drafter", default="auto",
                   help="drafter checkpoint (directory, shipped name or DeepSpec checkpoint), 'none' to decode with "
                        "the target alone, or 'auto': the drafter shipped for --target if there is one, else none "
                        "(default: %(default)s)")
    p.add_argument("--scheduler", type=scheduler_spec, default=None,
                   help=f"verification-length policy: {SCHEDULERS}. 'fixed:N' verifies N draft tokens (0: none), "
                        "'threshold:X' the leading ones with survival >= X, 'dspark-sync' Algorithm 1 over the "
                        "profiled SPS table, 'dspark' the deployed variant (§5.2: capacity from two-step-old "
                        "confidence). "
                        "Default: dspark, or none with --drafter none")
    p.add_argument("--max-batch", type=_positive_int, default=16,
                   help="most requests decoded together (default: %(default)s)")
    p.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="most tokens per request, prompt plus completion (default: the target's context, at most "
                        "2048)")
    p.add_argument("--page-size", type=_positive_int, default=16,
                   help="tokens per KV-cache page (default: %(default)s)")
    p.add_argument("--num-pages", type=_positive_int, default=None,
                   help="KV pages in the pool (default: enough for max-batch requests of max-model-len; fewer "
                        "pages serve more requests per GB and preempt when full)")
    p.add_argument("--tensor-parallel", type=_positive_int, default=1,
                   help="devices to shard the target and drafter over (heads, FFN, vocabulary; default: "
                        "%(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=_port, default=8000, help="port to listen on; 0 picks a free one (default: "
                                                            "%(default)s)")
    p.add_argument("--kernels", choices=KERNELS, default="auto",
                   help="attention/sampling kernels: auto (Pallas where measured faster: attention on GPU/TPU, "
                        "the sampler on TPU), reference (plain jnp) or pallas (default: %(default)s)")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="weights and activations of target and drafter: auto (bfloat16 on GPU/TPU, float32 on CPU, "
                        "where bf16 matmuls are slow), bfloat16 or float32; logits and attention scores are float32 "
                        "either way (default: %(default)s)")
    p.add_argument("--kv-dtype", choices=DTYPES, default="auto",
                   help="dtype of the paged KV cache: auto (the --dtype), bfloat16 (half the memory per page) or "
                        "float32; attention reads it up to float32 (default: %(default)s)")
    p.add_argument("--sps-out", default=None, metavar="PATH",
                   help="write the SPS table profiled at start-up (steps/s by batch bucket, tokens per pass and "
                        "context length) to this JSON file")
    p.add_argument("--startup", choices=("background", "blocking"), default="background",
                   help="background: answer as soon as one request's programs are compiled (prefill and the "
                        "batch-of-one steps; the dspark scheduler takes plain steps), then compile the rest and "
                        "profile the SPS table while idle and switch to speculation when it is ready (logged). "
                        "blocking: compile every shape and profile before serving (default: %(default)s)")
    p.add_argument("--sps-table", default=None, metavar="PATH",
                   help="load a saved SPS table (an earlier --sps-out) instead of profiling at start-up; it must "
                        "cover this configuration's step shapes")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' on every /v1/* route (401 otherwise; /health and "
                        "/metrics stay open). Default: no key")
    p.add_argument("--max-waiting", type=_positive_int, default=256,
                   help="requests admitted but not yet started, across the server; beyond it new requests get 429 "
                        "with Retry-After (default: %(default)s)")
    p.add_argument("--request-timeout", type=_positive_float, default=600.0, metavar="SECONDS",
                   help="a request running longer is aborted: 504, or an error event ending its stream "
                        "(default: %(default)s)")
    p.add_argument("--max-body-bytes", type=_positive_int, default=4 << 20,
                   help="largest request body accepted; larger ones get 413 (default: %(default)s)")
    p.add_argument("--max-prompt-logprobs", type=_positive_int, default=1 << 17,
                   help="most prompt-logprob entries one `echo` request may ask for: prompt tokens x (logprobs + 1), "
                        "summed over its choices; beyond it 400 (default: %(default)s)")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="logging level (default: %(default)s)")
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="keep compiled XLA programs in this directory so a restart with the same flags skips most "
                        "compilation (jax's persistent compilation cache; trusted: do not share it with users you do "
                        "not trust); 'none' turns it off (default: xla/ in the dspark_jax cache, $DSPARK_JAX_CACHE "
                        "or ~/.cache/dspark_jax)")
    args = p.parse_args(argv)
    if args.drafter == "none" and args.scheduler not in (None, "none", "fixed:0"):
        p.error(f"--scheduler {args.scheduler} needs a drafter; drop it or pass --drafter")
    return args


def enable_compile_cache(path: str | None = None) -> str:
    """Turns on jax's persistent compilation cache in `path` (default: xla/ under `dspark_jax.hub.cache_dir()`)
    before the first compilation; returns the directory. Programs that compile in under half a second are not
    worth a disk read and stay out of it. Raises OSError when the directory cannot be made."""
    import jax

    from dspark_jax.hub import cache_dir

    path = path or os.path.join(cache_dir(), "xla")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return path


def chat_template_of(engine):
    """messages -> prompt ids: `engine.chat_template` if callable; a jinja string, or none (then the
    tokenizer's own `chat_template`), is rendered with `ChatFormatter`."""
    from serve.text import ChatFormatter, as_text_tokenizer

    template = getattr(engine, "chat_template", None)
    if callable(template):
        return template
    if isinstance(template, str):
        return ChatFormatter(template, as_text_tokenizer(engine.tokenizer).encode)
    return ChatFormatter.from_tokenizer(engine.tokenizer)


def _exit_when_engine_dies(engine, stopping: threading.Event, poll_s: float = 1.0) -> None:
    """Watchdog thread: exits the process (status 70) once the engine reports unhealthy, unless we are stopping."""
    while not stopping.wait(poll_s):
        try:
            ok = bool(engine.health())
        except Exception:
            ok = False
        if not ok and not stopping.is_set():
            logging.getLogger(__name__).critical("the engine loop died; exiting with status 70")
            logging.shutdown()
            os._exit(70)


def main(argv=None) -> int:
    args = parse_args(argv)
    from dspark_jax.logs import configure_logging, third_party_level  # no JAX import

    configure_logging(args.log_level)  # ours at --log-level; jax, absl, uvicorn ... at WARNING unless debug
    from serve.server import build_app, serve_forever

    try:
        if args.compile_cache != "none":
            enable_compile_cache(args.compile_cache)
        from serve.startup import EngineConfig, create_engine  # imported here: it pulls in JAX

        config = EngineConfig(target=args.target, drafter=None if args.drafter == "none" else args.drafter,
                              scheduler=args.scheduler, max_batch=args.max_batch, max_model_len=args.max_model_len,
                              page_size=args.page_size, num_pages=args.num_pages, kernels=args.kernels,
                              mesh_shape=(1, args.tensor_parallel), sps_table=args.sps_table, sps_out=args.sps_out,
                              dtype=args.dtype, kv_dtype=args.kv_dtype, background=args.startup == "background")
        engine = create_engine(config, progress=True)
    except (ValueError, OSError) as e:  # bad model spec, drafter/target mismatch, sizes, unwritable --sps-out
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    if hasattr(engine, "exit_on_fatal"):
        engine.exit_on_fatal = True  # the engine thread exits the process after failing every request
    stopping = threading.Event()
    try:
        try:
            app = build_app(engine, engine.tokenizer, chat_template=chat_template_of(engine), api_key=args.api_key,
                            max_waiting=args.max_waiting, request_timeout_s=args.request_timeout,
                            max_body_bytes=args.max_body_bytes, max_prompt_logprobs=args.max_prompt_logprobs)
        except (ValueError, OSError) as e:  # no chat template, unwritable --sps-out
            print(f"error: {e}", file=sys.stderr)
            return 2

        def ready(url: str) -> None:
            print(f"serving {engine.model_name} at {url}/v1 (health: {url}/health, metrics: {url}/metrics)",
                  flush=True)

        threading.Thread(target=_exit_when_engine_dies, args=(engine, stopping), name="engine-watchdog",
                         daemon=True).start()
        serve_forever(app, args.host, args.port, log_level=third_party_level(args.log_level), on_ready=ready)
    finally:
        stopping.set()
        for name in ("close", "stop"):  # whichever the engine has: ends its thread
            if callable(getattr(engine, name, None)):
                getattr(engine, name)()
                break
    return 0


if __name__ == "__main__":
    sys.exit(main())
