"""load_tokenizer parses a model's tokenizer once per process: engines of one model share it, and a changed file
(or another folder) is parsed again."""

from __future__ import annotations

import os
import shutil

from kvserve.loader.tokenizer import load_tokenizer


def test_one_parse_per_unchanged_folder(tiny_model_factory, tmp_path):
    path = tiny_model_factory("llama-gqa-untied")
    first = load_tokenizer(path)
    assert load_tokenizer(path) is first
    copy = shutil.copytree(path, tmp_path / "copy")
    other = load_tokenizer(str(copy))
    assert other is not first and other("hello world").input_ids == first("hello world").input_ids
    config = os.path.join(copy, "tokenizer_config.json")
    os.utime(config, ns=(os.stat(config).st_atime_ns, os.stat(config).st_mtime_ns + 10**9))
    assert load_tokenizer(str(copy)) is not other  # a file changed: parsed again
