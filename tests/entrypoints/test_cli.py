"""`kvserve generate` end to end on a tiny model."""

from kvserve.entrypoints.cli import main


def test_generate_prints_completion(tiny_model_factory, capsys):
    model = tiny_model_factory("llama-gqa-untied")
    rc = main(
        [
            "generate",
            "Hello",
            "--model",
            model,
            "--dtype",
            "float32",
            "--max-tokens",
            "5",
            "--no-chat",
            "--max-model-len",
            "128",
        ]
    )
    out = capsys.readouterr()
    assert rc == 0
    assert out.out.startswith("Hello") and len(out.out.strip()) > len("Hello")
    assert "5 tokens" in out.err and "finish_reason=length" in out.err


def test_generate_chat_mode_and_bad_input(tiny_model_factory, capsys):
    model = tiny_model_factory("llama-gqa-untied")
    assert (
        main(
            [
                "generate",
                "Hi",
                "--model",
                model,
                "--dtype",
                "float32",
                "--max-tokens",
                "3",
                "--max-model-len",
                "128",
            ]
        )
        == 0
    )
    rc = main(["generate", "Hi", "--model", model, "--temperature", "-1", "--max-model-len", "128"])
    assert rc == 2 and "temperature" in capsys.readouterr().err


def test_kv_transfer_and_swap_flags_reach_the_engine_config(tiny_model_factory):
    from kvserve.engine.arg_utils import EngineArgs
    from kvserve.entrypoints.cli import build_parser

    model = tiny_model_factory("llama-gqa-untied")
    for command in (["serve"], ["bench", "throughput"], ["bench", "offload"]):
        ns = build_parser().parse_args(
            [
                *command,
                "--model",
                model,
                "--kv-transfer-config",
                '{"kv_connector": "offload", "cpu_bytes": "64MiB", "disk_path": "/tmp/x"}',
                "--preemption-mode",
                "swap",
                "--swap-space",
                "16MiB",
            ]
        )
        config = EngineArgs.from_cli_args(ns).create_engine_config()
        assert config.kv_transfer is not None and config.kv_transfer.kv_connector == "offload"
        assert config.kv_transfer.options == {"cpu_bytes": "64MiB", "disk_path": "/tmp/x"}
        assert config.scheduler.preemption_mode == "swap" and config.cache.swap_space == 16 << 20
