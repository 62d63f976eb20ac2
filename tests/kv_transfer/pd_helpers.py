"""Two in-process engines joined by the pd connector, for tests: a producer (prefill) LLM stepped on a background
thread, so that its side channel can serve a consumer (decode) LLM that the test drives."""

from __future__ import annotations

import threading
import time

from kvserve import LLM, SamplingParams


def pd_config(role: str, **options) -> dict:
    return {"kv_connector": "pd", "kv_role": role, "side_channel_host": "127.0.0.1", **options}


class Producer:
    """`prefill(prompt)` runs one prompt to its first token with do_remote_decode and returns the params; between
    calls a thread keeps stepping the engine (its leases must be handed to the workers and their ends reported)."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.engine = llm.engine
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._n = 0
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                busy = self.engine.has_unfinished_requests()
                if busy:
                    self.engine.step()
            if not busy:
                time.sleep(0.002)

    def prefill(self, prompt_ids: list[int], **params) -> dict:
        with self._lock:
            self._n += 1
            req_id = f"p{self._n}"
            extra = {"kv_transfer_params": {"do_remote_decode": True}}
            self.engine.add_request(
                req_id, {"prompt_token_ids": prompt_ids}, SamplingParams(temperature=0, max_tokens=1, extra_args=extra)
            )
            while True:
                for out in self.engine.step():
                    if out.request_id == req_id and out.finished:
                        return out.kv_transfer_params

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until every kept request's lease has ended and its blocks are free."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            with self._lock:
                if not self.engine.has_unfinished_requests():
                    return
            time.sleep(0.01)
        raise AssertionError("the producer still holds requests")

    def stats(self) -> dict:
        with self._lock:
            return self.llm.stats()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.llm.shutdown()


def remote(params: dict, max_tokens: int = 12, **kw) -> SamplingParams:
    """Greedy (unless `kw` says otherwise) with the producer's params."""
    kw = {"temperature": 0, "ignore_eos": True, **kw}
    return SamplingParams(max_tokens=max_tokens, extra_args={"kv_transfer_params": params}, **kw)
