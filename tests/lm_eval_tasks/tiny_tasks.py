"""Loaders of the tiny lm-eval tasks in this folder (tests/test_lm_eval.py; docs/serving.md, 'Evaluating through
the server'): each reads the jsonl file beside it, so the tasks need no download and run from any directory.
The words are those of the test's word-level tokenizer ("w3".."w127", one token each)."""

from __future__ import annotations

import json
import pathlib

HERE = pathlib.Path(__file__).parent


def _load(name: str) -> dict:
    import datasets

    with open(HERE / f"{name}.jsonl") as f:
        return {"test": datasets.Dataset.from_list([json.loads(line) for line in f if line.strip()])}


def choice(**kwargs) -> dict:
    """dspark_tiny_choice: multiple choice (loglikelihood of each choice after the question)."""
    return _load("dspark_tiny_choice")


def greedy(**kwargs) -> dict:
    """dspark_tiny_greedy: generate_until (greedy continuations of a prompt)."""
    return _load("dspark_tiny_greedy")
