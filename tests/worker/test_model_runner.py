"""ModelRunner wiring: the attention backend from the selector, the KV cache in its layout, shutdown."""

from __future__ import annotations

from kvserve.attention.cpu_kernels import CpuKernelAttentionBackend
from kvserve.attention.torch_ref import TorchRefAttentionBackend
from kvserve.engine.arg_utils import EngineArgs
from kvserve.kernels.cpu import load_cpu_kernels
from kvserve.worker.model_runner import ModelRunner


def test_runner_uses_the_selected_backend_and_shutdown_stops_the_prefault(tiny_model_factory):
    path = tiny_model_factory("llama-gqa-untied")
    # A pool big enough that the background prefault is still running when shutdown comes.
    args = EngineArgs(model=path, dtype="float32", max_model_len=128, kv_cache_memory=1 << 30, kv_prefault="background")
    config = args.create_engine_config()
    runner = ModelRunner(config.model, config.cache, config.scheduler)
    runner.initialize_kv_cache(runner.determine_num_kv_blocks())
    want = CpuKernelAttentionBackend if load_cpu_kernels() is not None else TorchRefAttentionBackend
    assert isinstance(runner.attn_backend, want)
    shape = runner.attn_backend.kv_cache_shape(runner.num_blocks, runner.block_size)
    assert all(k.shape == v.shape == shape for k, v in runner.kv_caches)
    thread = runner._prefault_thread
    assert thread is not None
    runner.shutdown()
    assert runner._prefault_stop.is_set() and not thread.is_alive()
    runner.shutdown()  # idempotent
