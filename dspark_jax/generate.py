"""`python -m dspark_jax.generate`: chat-templated generation from the command line, streaming to stdout.

Target-only by default; `--drafter` decodes speculatively (the output is the same for greedy decoding, and
identically distributed when sampling). `--json` prints token ids, timings and the dtypes used instead of
streaming text. `--dtype auto` (the default) is bfloat16 on GPU/TPU and float32 on CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types

from dspark_jax import hub
from dspark_jax.target import DTYPE_CHOICES, dtype_name, resolve_dtype


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dspark_jax.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", required=True, help="the user message; the model's chat template wraps it")
    p.add_argument("--target", default=hub.DEFAULT_TARGET,
                   help="a Hugging Face model directory, a .gguf file, or a known name "
                        f"({', '.join(hub.list_known_targets())}); default: %(default)s")
    p.add_argument("--drafter", default=None,
                   help="drafter checkpoint directory or shipped name for speculative decoding (default: none)")
    p.add_argument("--max-tokens", type=int, default=128, help="maximum new tokens (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass to keep; 1.0 = off")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="keep tokens at least this fraction as likely as the most likely one; 0 = off")
    p.add_argument("--logit-bias", default=None, metavar="JSON",
                   help='OpenAI\'s logit_bias: a JSON object of token ids to biases in [-100, 100], e.g. '
                        '\'{"2": -100}\' bans token 2 (default: none)')
    p.add_argument("--min-tokens", type=int, default=0,
                   help="no EOS before this many new tokens (vLLM's min_tokens; default: %(default)s)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted once from each token already generated, in [-2, 2]; 0 = off")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted per occurrence of each token already generated, in [-2, 2]; 0 = off")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divides positive (multiplies negative) logits of prompt and generated tokens, in "
                        "[0.01, 10]; 1 = off")
    p.add_argument("--seed", type=int, default=0, help="random seed; a fixed seed gives a fixed output")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="parameter/activation dtype: auto (bfloat16 on GPU/TPU, float32 on CPU, where bf16 GEMMs "
                        "are slow), bfloat16 or float32 (default: %(default)s)")
    p.add_argument("--kv-dtype", choices=DTYPE_CHOICES, default="auto",
                   help="dtype of the paged KV cache: auto (the --dtype), bfloat16 or float32; attention reads it "
                        "up to float32 (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object with token ids and timings")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import dspark_jax

    try:
        if args.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
        from dspark_jax.penalties import check_frequency_penalty, check_presence_penalty, check_repetition_penalty
        from dspark_jax.sampling import check_min_p, check_min_tokens, check_params

        check_params(args.temperature, args.top_k, args.top_p)  # validate before the slow model load
        check_min_p(args.min_p)
        check_min_tokens(args.min_tokens, args.max_tokens)
        check_presence_penalty(args.presence_penalty)
        check_frequency_penalty(args.frequency_penalty)
        check_repetition_penalty(args.repetition_penalty)
        try:
            logit_bias = None if args.logit_bias is None else json.loads(args.logit_bias)
        except json.JSONDecodeError as e:
            raise ValueError(f"--logit-bias is not JSON: {e}") from None
        if logit_bias is not None and not isinstance(logit_bias, dict):
            raise ValueError("--logit-bias must be a JSON object of token ids to biases")
        t0 = time.perf_counter()
        target = dspark_jax.load_target(args.target, dtype=args.dtype)
        drafter = dspark_jax.load_drafter(args.drafter, target) if args.drafter else None
        load_s = time.perf_counter() - t0
        prompt = target.chat_ids(args.prompt)
        streamed: list[int] = []
        shown = [""]

        def stream(row, new):
            streamed.extend(new)
            text = target.tokenizer.decode(streamed, skip_special_tokens=True)
            sys.stdout.write(text[len(shown[0]):])
            sys.stdout.flush()
            shown[0] = text

        res = dspark_jax.generate(target, [prompt], drafter, max_new_tokens=args.max_tokens,
                                  temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                  min_p=args.min_p, logit_bias=logit_bias, min_tokens=args.min_tokens, seed=args.seed,
                                  presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                                  repetition_penalty=args.repetition_penalty,
                                  on_tokens=None if args.json else stream, kv_dtype=args.kv_dtype)
    except ValueError as e:  # ModelSpecError and bad parameters: one line, exit 2, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    if args.json:
        toks = res.tokens[0]
        dec = res.timings["decode_s"]
        print(json.dumps({"prompt_ids": prompt, "tokens": toks,
                          "text": target.tokenizer.decode(toks, skip_special_tokens=True),
                          "stats": res.stats, "timings": {**res.timings, "load_s": load_s},
                          "dtype": dtype_name(target.dtype),
                          "kv_dtype": resolve_dtype(args.kv_dtype, auto=dtype_name(target.dtype)),
                          "decode_tokens_per_s": (len(toks) - 1) / dec if dec > 0 else None}))
    else:
        print()
    return 0


class _CallableModule(types.ModuleType):
    """`dspark_jax.generate` names both the public function and this CLI module (`python -m dspark_jax.generate`
    is the documented entry point). Importing this module rebinds the package attribute to the module, so the
    module forwards calls to the function: `dspark_jax.generate(...)` works either way."""

    def __call__(self, *args, **kwargs):
        from dspark_jax.decoding import generate

        return generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
