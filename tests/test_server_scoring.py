"""Evaluation-grade completions through the server (serve/server.py, serve/generation.py) against the
hand-computable FakeEngine of test_server.py: `echo` with prompt logprobs, `max_tokens: 0` scoring, batched
prompts (choices indexed prompt × n, as OpenAI does), and vLLM's /tokenize, /detokenize and /tokenizer_info.

The request shapes are the ones EleutherAI's lm-eval harness sends (`local-completions`): loglikelihood as
{"prompt": [[ids], ...], "echo": true, "logprobs": 1, "max_tokens": 1, "temperature": 0}, read back as
choices[i].logprobs.token_logprobs[ctxlen:-1]; the real harness runs in tests/test_lm_eval.py.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from test_server import (
    EOS,
    IM_START,
    MODEL,
    FakeEngine,
    app_for,
    expected_ids,
    fake_logprob,
    fake_top,
    text,
)

from serve import responses as R
from serve.server import ServerThread


@pytest.fixture(scope="module")
def engine():
    eng = FakeEngine()
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(app_for(engine, max_prompt_logprobs=600)) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=10)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=10) as c:
        yield c


@pytest.fixture(autouse=True)
def _pages_back(engine):
    yield
    assert engine.wait_idle(), f"{engine.free_pages=} != {engine.total_pages=}"


def _top(t: int, k: int) -> dict:
    """top_logprobs of a token: its k alternatives and itself."""
    return {f"t{a}": max(lp, -9999.0) for a, lp in fake_top(t, k)} | {f"t{t}": fake_logprob(t)}


def test_echo_prepends_the_prompt_and_its_logprobs(client):
    gen = expected_ids(3, 3)  # 24, 71, 0
    r = client.completions.create(model=MODEL, prompt="t1 t2 t3", max_tokens=3, temperature=0, echo=True, logprobs=2)
    c = r.choices[0]
    assert c.text == "t1 t2 t3 t24 t71 t0"  # the completion continues the prompt as decode(prompt + completion)
    lp = c.logprobs
    assert lp.tokens == ["t1", "t2", "t3"] + [f"t{t}" for t in gen]
    assert lp.token_logprobs == [None] + [fake_logprob(t) for t in [2, 3] + gen]  # nothing predicts the first
    assert lp.top_logprobs == [None] + [_top(t, 2) for t in [2, 3] + gen]
    assert lp.text_offset == [0, 2, 5, 8, 12, 16]
    assert [c.text[o:].split()[0] for o in lp.text_offset] == lp.tokens
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (3, 3)
    # echo without logprobs: text only; a token-id prompt echoes its decoding
    r = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text == "t1 t2 t3 t24 t71 t0" and r.choices[0].logprobs is None
    # a stop string applies to the completion only
    r = client.completions.create(model=MODEL, prompt="t1 t2 t3", max_tokens=3, echo=True, stop="t71", logprobs=0)
    assert r.choices[0].text == "t1 t2 t3 t24 " and r.choices[0].logprobs.tokens[-1] == "t71"


def test_max_tokens_0_scores_the_prompt_only(client, http):
    r = client.completions.create(model=MODEL, prompt="t4 t5 t6", max_tokens=0, echo=True, logprobs=1)
    c = r.choices[0]
    assert c.text == "t4 t5 t6" and c.finish_reason == "length"
    assert c.logprobs.token_logprobs == [None, fake_logprob(5), fake_logprob(6)]
    assert c.logprobs.top_logprobs == [None, _top(5, 1), _top(6, 1)]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (3, 0)
    err = http.post("/v1/completions", json={"model": MODEL, "prompt": "t4", "max_tokens": 0}).json()["error"]
    assert err["param"] == "max_tokens" and "echo" in err["message"]


def test_batched_prompts_index_choices_prompt_by_n(client, engine):
    r = client.completions.create(model=MODEL, prompt=[[1], [5, 6]], n=2, max_tokens=4, temperature=0.7, seed=10)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    want = [expected_ids(1, 4, 10), expected_ids(1, 4, 11), expected_ids(6, 4, 10), expected_ids(6, 4, 11)]
    assert [c.text for c in r.choices] == [" ".join(f"t{t}" for t in w) for w in want]
    assert [q.params.seed for q in engine.added[-4:]] == [10, 11, 10, 11]  # seed + j for the j-th of a prompt
    assert [q.prompt_ids for q in engine.added[-4:]] == [[1], [1], [5, 6], [5, 6]]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (3, 16)  # each prompt counted once
    r = client.completions.create(model=MODEL, prompt=["t7", "t8 t9"], max_tokens=2, temperature=0, echo=True)
    assert [c.text for c in r.choices] == ["t7 " + "t52 t67", "t8 t9 " + "t66 t65"]


def test_lm_eval_loglikelihood_request(http):
    """lm-eval's loglikelihood batch: context + continuation as token ids, the continuation scored by
    token_logprobs[ctxlen:-1] and greedy when each is its position's top logprob."""
    ctx, cont = [10, 11, 12], [13, 14]
    body = {"model": MODEL, "prompt": [ctx + cont, [4, 5]], "echo": True, "logprobs": 1, "max_tokens": 1,
            "temperature": 0, "seed": 1234}
    out = http.post("/v1/completions", json=body).json()
    R.CompletionResponse.model_validate(out)
    c = sorted(out["choices"], key=lambda c: c["index"])
    assert c[0]["logprobs"]["token_logprobs"][len(ctx):-1] == [fake_logprob(13), fake_logprob(14)]
    assert c[1]["logprobs"]["token_logprobs"] == [None, fake_logprob(5), fake_logprob(next_id := 38)]
    assert c[1]["logprobs"]["tokens"][-1] == f"t{next_id}"
    top = c[0]["logprobs"]["top_logprobs"][len(ctx)]
    assert top == _top(13, 1)


def test_the_stop_token_is_counted_and_listed_but_not_shown(client, http):
    """As vLLM: the token that stops a choice (EOS or a stop token id) counts in usage and comes last in the
    logprobs, with no text. So lm-eval's token_logprobs[ctxlen:-1] is still the continuation's when the target's
    next token after it is the stop (here the fake's next token after t14 is t1)."""
    ctx, cont = [10, 11, 12], [13, 14]
    body = {"model": MODEL, "prompt": ctx + cont, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0,
            "stop_token_ids": [1]}
    out = http.post("/v1/completions", json=body).json()
    c = out["choices"][0]
    assert (c["text"], c["finish_reason"]) == ("t10 t11 t12 t13 t14", "stop")
    lp = c["logprobs"]
    assert lp["token_logprobs"][len(ctx):-1] == [fake_logprob(13), fake_logprob(14)]
    assert (lp["tokens"][-1], lp["token_logprobs"][-1], lp["text_offset"][-1]) == ("t1", fake_logprob(1), 19)
    assert out["usage"]["completion_tokens"] == 1
    # Generated text: "t10 t73" then t14 stops it (listed, not shown); streamed the same.
    r = client.completions.create(model=MODEL, prompt="t1", max_tokens=9, logprobs=0,
                                  extra_body={"stop_token_ids": [14]})
    got = r.choices[0]
    assert (got.text, got.finish_reason, r.usage.completion_tokens) == ("t10 t73", "stop", 3)
    assert (got.logprobs.tokens, got.logprobs.text_offset) == (["t10", "t73", "t14"], [0, 3, 7])
    chunks = list(client.completions.create(model=MODEL, prompt="t1", max_tokens=9, logprobs=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"stop_token_ids": [14]}))
    assert sum((c.choices[0].logprobs.tokens for c in chunks if c.choices and c.choices[0].logprobs), []) == [
        "t10", "t73", "t14"]
    assert chunks[-1].usage.completion_tokens == 3
    # Without logprobs it is still counted; chat lists it too.
    r = client.completions.create(model=MODEL, prompt="t1", max_tokens=9, extra_body={"stop_token_ids": [14]})
    assert (r.choices[0].text, r.usage.completion_tokens) == ("t10 t73", 3)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "t1"}], max_tokens=9,
                                       logprobs=True, extra_body={"stop_token_ids": [14]})
    assert [x.token for x in r.choices[0].logprobs.content][-1] == "t14" and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(r.choices[0].logprobs.content)


def test_echo_streams_the_prompt_first(client):
    chunks = list(client.completions.create(model=MODEL, prompt=[[1, 2], [3]], max_tokens=3, temperature=0,
                                            echo=True, logprobs=0, stream=True))
    for i, prompt in enumerate(([1, 2], [3])):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == i]
        assert mine[0].text.startswith(" ".join(f"t{t}" for t in prompt))
        text = "".join(m.text for m in mine)
        gen = expected_ids(prompt[-1], 3)
        assert text == " ".join(f"t{t}" for t in prompt + gen)
        lps = sum((m.logprobs.token_logprobs for m in mine if m.logprobs), [])
        assert lps == [None] + [fake_logprob(t) for t in prompt[1:] + gen]


@pytest.mark.parametrize("body,entries", [  # the server's bound here: 600 = prompt tokens × (logprobs + 1) × n
    ({"prompt": [[1] * 100] * 6, "logprobs": 0}, 600), ({"prompt": [[1] * 100] * 6, "logprobs": 1}, 1200),
    ({"prompt": [1] * 100, "logprobs": 5}, 600), ({"prompt": [1] * 60, "logprobs": 4, "n": 3}, 900),
    ({"prompt": ["t1 " * 200], "logprobs": 2}, 600), ({"prompt": ["t1 " * 201], "logprobs": 2}, 603),
])
def test_prompt_logprob_cost_is_bounded(http, body, entries):
    r = http.post("/v1/completions", json={"model": MODEL, "max_tokens": 1, "echo": True, **body})
    if entries <= 600:
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("prompt", "prompt_logprobs_too_large"), err
    assert f"{entries} prompt logprobs" in err["message"] and "600" in err["message"]


def test_too_many_choices_is_400_not_429(engine):
    with ServerThread(app_for(engine, max_waiting=8)) as s, httpx.Client(base_url=s.base_url, timeout=10) as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": ["t1"] * 5, "n": 2, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_choices", r.text
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": ["t1"] * 4, "n": 2, "max_tokens": 1})
        assert r.status_code == 200 and len(r.json()["choices"]) == 8


def test_tokenize_detokenize_and_tokenizer_info(http):
    r = http.post("/tokenize", json={"model": MODEL, "prompt": "t1 t2 <|im_end|>"}).json()
    assert r == {"count": 3, "max_model_len": 256, "tokens": [1, 2, EOS], "token_strs": None}
    r = http.post("/tokenize", json={"prompt": "t5 t6", "return_token_strs": True, "add_special_tokens": True})
    assert r.json()["token_strs"] == ["t5", "t6"]
    r = http.post("/tokenize", json={"messages": [{"role": "user", "content": "t1"}]}).json()
    assert r["tokens"] == [IM_START, 1, EOS, IM_START]  # as /v1/chat/completions renders them
    assert http.post("/detokenize", json={"tokens": [1, 2, EOS]}).json() == {"prompt": "t1 t2"}
    assert http.post("/detokenize", json={"model": MODEL, "tokens": []}).json() == {"prompt": ""}
    for path, body, param in (("/detokenize", {"tokens": [FakeEngine.vocab_size]}, "tokens"),
                              ("/detokenize", {"tokens": [-1]}, "tokens.0"),
                              ("/tokenize", {"prompt": "t1", "messages": [{"role": "user", "content": "t1"}]},
                               "prompt"), ("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": 3}, "prompt"),
                              ("/tokenize", {"prompt": "t1", "frobnicate": 1}, "frobnicate")):
        r = http.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)
    assert http.post("/tokenize", json={"model": "gpt-4", "prompt": "t1"}).status_code == 404
    assert http.post("/tokenize", content=b"t1", headers={"content-type": "text/plain"}).status_code == 415
    info = http.get("/tokenizer_info").json()
    assert info["tokenizer_class"] == "Tokenizer" and info["model_max_length"] == 256 and "eos_token" in info


def test_tokenizer_info_of_a_transformers_tokenizer():
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    from serve.server import tokenizer_info

    tok = Tokenizer(models.WordLevel({"a": 0, "</s>": 1}, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="a")
    fast.chat_template = "{{ messages }}"
    info = tokenizer_info(fast, 64)
    assert info == {"tokenizer_class": type(fast).__name__, "eos_token": "</s>", "bos_token": None,
                    "pad_token": None, "unk_token": "a", "chat_template": "{{ messages }}", "model_max_length": 64}
    json.dumps(info)


def test_openapi_describes_the_new_routes_and_fields(http):
    doc = http.get("/openapi.json").json()
    assert {"/tokenize", "/detokenize", "/tokenizer_info"} <= set(doc["paths"])
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert props["echo"]["anyOf"][0] == {"type": "boolean"} and props["max_tokens"]["anyOf"][0]["minimum"] == 0
    batch = [a for a in props["prompt"]["anyOf"] if a["type"] == "array" and a["items"].get("type") == "array"]
    assert batch[0]["items"]["items"]["maximum"] == FakeEngine.vocab_size - 1 and batch[0]["maxItems"] == 128


# ---- vLLM's request extras ------------------------------------------------------------------------------------
def _bos_app(engine, template=None):
    """The server over a tokenizer that prepends a BOS (here <|im_start|>) to a text, as Llama's do."""
    from test_server import TEMPLATE, make_tokenizer
    from tokenizers import processors

    from serve.server import build_app
    from serve.text import ChatFormatter, TokenizerAdapter

    tok = make_tokenizer()
    tok.post_processor = processors.TemplateProcessing(single="<|im_start|> $A",
                                                       special_tokens=[("<|im_start|>", IM_START)])
    return build_app(engine, tok, chat_template=ChatFormatter(template or TEMPLATE, TokenizerAdapter(tok).encode))


def test_string_prompts_get_the_tokenizers_special_tokens_as_in_vllm(engine):
    """Completions and /tokenize encode a string prompt with its BOS unless `add_special_tokens` is false; token
    ids and chat prompts (the template writes its own) are left as they are."""
    with ServerThread(_bos_app(engine)) as s, httpx.Client(base_url=s.base_url, timeout=10) as c:
        def sent(body, path="/v1/completions"):
            r = c.post(path, json={"model": MODEL, "max_tokens": 2, **body})
            assert r.status_code == 200, r.text
            return engine.added[-1].prompt_ids, r.json()

        ids, out = sent({"prompt": "t1", "echo": True})
        assert ids == [IM_START, 1] and out["choices"][0]["text"] == "t1 " + text(expected_ids(1, 2))
        assert out["usage"]["prompt_tokens"] == 2
        assert sent({"prompt": "t1", "add_special_tokens": False})[0] == [1]
        assert sent({"prompt": [5, 6]})[0] == [5, 6]
        assert sent({"messages": [{"role": "user", "content": "t1"}]}, "/v1/chat/completions")[0] == [
            IM_START, 1, EOS, IM_START]
        assert c.post("/tokenize", json={"prompt": "t1"}).json()["tokens"] == [IM_START, 1]
        assert c.post("/tokenize", json={"prompt": "t1", "add_special_tokens": False}).json()["tokens"] == [1]
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "t1"}],
                                                 "add_special_tokens": True})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter", r.text


def test_chat_template_kwargs_and_add_generation_prompt(engine):
    template = ("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>{% if think is defined and not think %}t9{% endif %}"
                "{% endif %}{% if rep is defined %}{{ ' t2' * rep }}{% endif %}{% if d is defined %}{{ 1 / d }}"
                "{% endif %}{% if p is defined %}{{ 2 ** p }}{% endif %}")
    msgs = [{"role": "user", "content": "t1"}]
    with ServerThread(_bos_app(engine, template)) as s, httpx.Client(base_url=s.base_url, timeout=10) as c:
        def ids(**extra):
            r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 1, **extra})
            return engine.added[-1].prompt_ids if r.status_code == 200 else r.json()["error"]

        assert ids() == [IM_START, 1, EOS, IM_START]
        assert ids(chat_template_kwargs={"think": False}) == [IM_START, 1, EOS, IM_START, 9]
        assert ids(chat_template_kwargs={"think": True}) == [IM_START, 1, EOS, IM_START]
        assert ids(add_generation_prompt=False) == [IM_START, 1, EOS]
        assert ids(chat_template_kwargs={"rep": 2}) == [IM_START, 1, EOS, IM_START, 2, 2]
        for bad in ({"messages": "t1"}, {"tools": "t1"}, {"documents": 1}, {"v": [1]}, {"v": {"a": 1}}):
            err = ids(chat_template_kwargs=bad)
            assert err["param"].startswith("chat_template_kwargs") and err["code"] == "invalid_value", (bad, err)
        # Whatever the template does with a request's values is the request's fault (400), and bounded.
        for bad in ({"d": 0}, {"rep": 10**9}, {"p": 10**9}):
            err = ids(chat_template_kwargs=bad)
            assert (err["param"], err["code"]) == ("messages", "invalid_value"), (bad, err)
        # /tokenize renders a chat the same way.
        r = c.post("/tokenize", json={"messages": msgs, "chat_template_kwargs": {"think": False}})
        assert r.json()["tokens"] == [IM_START, 1, EOS, IM_START, 9], r.text
        r = c.post("/tokenize", json={"prompt": "t1", "add_generation_prompt": False})
        assert r.status_code == 400, r.text


@pytest.mark.parametrize("extra,param", [
    ({"skip_special_tokens": True, "spaces_between_special_tokens": True, "include_stop_str_in_output": True,
      "min_tokens": 2, "use_beam_search": False, "priority": 3, "prompt_cache_key": "k", "safety_identifier": "s",
      "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": False}}, None),
    ({"skip_special_tokens": False}, "skip_special_tokens"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"min_tokens": 3}, "min_tokens"),  # more than max_tokens
    ({"use_beam_search": True}, "use_beam_search"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream: true
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats"),
])
def test_vllm_sampling_extras_at_their_defaults_are_accepted(http, extra, param):
    """vLLM clients send these at vLLM's defaults; a value this server does not implement is a 400 naming it."""
    for path, body in (("/v1/completions", {"prompt": "t1"}), ("/v1/chat/completions", {"messages": [
            {"role": "user", "content": "t1"}]})):
        r = http.post(path, json={"model": MODEL, "max_tokens": 2, **body, **extra})
        if param is None:
            assert r.status_code == 200, r.text
        else:
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
