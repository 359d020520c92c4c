"""AsyncEngine: the engine on its own thread, driven from asyncio (the workers' event loops).

Every call that touches engine state is marshalled onto the engine thread between steps, so the
engine itself stays single-threaded. Outputs flow back through per-request asyncio queues. A
consumer that stops iterating (client gone, task cancelled) aborts its request, which frees its
KV: nothing is left running for nobody.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from crossfill.engine.engine import EngineConfig, LLMEngine
from crossfill.engine.kv_events import KVEventBatch
from crossfill.engine.sampling import SamplingParams
from crossfill.engine.types import KVStats, LayerKVChunk, PrefillOutput, RequestOutput

log = logging.getLogger("crossfill.engine")
_warmup_ids = itertools.count()


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; the worker must be restarted."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], asyncio.Future, asyncio.AbstractEventLoop]]
        self._commands = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="crossfill-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_model(
        cls, name_or_path: str, *, kv_memory_mb: int = 512, max_num_seqs: int = 32, **engine_kwargs: Any
    ) -> AsyncEngine:
        cfg = EngineConfig(kv_memory_mb=kv_memory_mb, max_num_seqs=max_num_seqs, **engine_kwargs)
        return cls(LLMEngine.from_model(name_or_path, cfg))

    # --- model facts --------------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def layer_specs(self):
        return self.engine.layer_specs

    @property
    def fingerprint(self) -> str:
        return self.engine.fingerprint

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def eos_token_ids(self) -> list[int]:
        return sorted(self.engine.eos_token_ids)

    @property
    def block_size(self) -> int:
        return self.engine.block_size

    def kv_stats(self) -> KVStats:
        return self.engine.kv_stats()

    def kv_events_since(self, seq: int, epoch: str | None = None) -> KVEventBatch:
        """The prefix cache's hash events (LLMEngine.kv_events_since), read here directly rather
        than marshalled: the event log is thread-safe, and a health probe must not wait for a step."""
        return self.engine.kv_events_since(seq, epoch)

    # --- requests -----------------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, namespace: str = ""
    ) -> AsyncIterator[RequestOutput]:
        """Colocated prefill + decode; yields output deltas until the request finishes."""
        stream = self._open_stream(request_id)
        try:
            await self._call(
                lambda: self.engine.add_request(request_id, prompt_token_ids, params, namespace=namespace)
            )
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        async for out in self._drain(request_id, stream):
            yield out

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        namespace: str = "",
        export_from: int = 0,
    ) -> AsyncIterator[LayerKVChunk | PrefillOutput]:
        """Prefill-only: yields each layer's KV as it is computed, then the PrefillOutput.

        Only tokens from `export_from` on are exported (the decode side holds the ones before).
        """
        stream = self._open_stream(request_id)
        loop = asyncio.get_running_loop()

        def sink(chunk: LayerKVChunk) -> None:
            loop.call_soon_threadsafe(stream.put_nowait, chunk)

        try:
            await self._call(
                lambda: self.engine.add_request(
                    request_id, prompt_token_ids, params, namespace=namespace, prefill_only=True, kv_sink=sink,
                    export_from=export_from,
                )
            )
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        async for item in self._drain(request_id, stream):
            if isinstance(item, LayerKVChunk):
                yield item
            elif item.prefill is not None:
                yield item.prefill
            elif item.finished:
                raise RuntimeError(f"prefill of {request_id} ended without a result: {item.finish_reason}"
                                   + (f" ({item.error})" if item.error else ""))

    async def import_kv(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        namespace: str = "",
        reuse_prefix: bool = False,
    ) -> KVImportHandle:
        """Decode-only admission with the prompt's blocks allocated; raises NoKVCapacityError when full.

        With `reuse_prefix`, the prefix already cached in `namespace` is kept and
        `handle.cached_tokens` says how many leading tokens need not be sent.
        """
        seq = await self._call(
            lambda: self.engine.import_request(
                request_id, prompt_token_ids, params, namespace=namespace, reuse_prefix=reuse_prefix
            )
        )
        return KVImportHandle(self, request_id, cached_tokens=seq.num_cached_tokens)

    async def abort(self, request_id: str) -> bool:
        return await self._call(lambda: self.engine.abort(request_id))

    async def warmup(self) -> None:
        """One short forward pass, so the first user request does not pay for lazy initialisation."""
        rid = f"__warmup-{next(_warmup_ids)}"
        async for _ in self.generate(rid, [0], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)):
            pass

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    # --- plumbing -----------------------------------------------------------------------------
    def _open_stream(self, request_id: str) -> asyncio.Queue:
        if self._stopped:
            raise EngineDeadError("the engine has been shut down")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        return stream

    async def _drain(self, request_id: str, stream: asyncio.Queue) -> AsyncIterator[Any]:
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, RequestOutput) and item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # consumer went away: free the request's KV
                self._commands.put((lambda: self.engine.abort(request_id), None, None))
                self._wake.set()

    async def _call(self, fn: Callable[[], Any]) -> Any:
        return await self._submit(fn)

    def _submit(self, fn: Callable[[], Any]) -> asyncio.Future:
        """Queue `fn` for the engine thread (FIFO with every other call); its future resolves after it runs."""
        if self._stopped or not self._thread.is_alive():
            raise EngineDeadError("the engine thread is not running")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put((fn, future, loop))
        self._wake.set()
        return future

    def _run(self) -> None:
        engine = self.engine
        while not self._stopped:
            self._run_commands()
            for out in engine.take_pending():  # e.g. an import's first token: don't wait for a step
                self._deliver(out)
            if not engine.has_unfinished():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # never leave accepted requests hanging
                log.exception("engine step failed; failing every active request")
                outputs = self._fail_all(exc)
            for out in outputs:
                self._deliver(out)
            if not outputs and not engine.last_step_ran:
                # Nothing could run: waiting requests need blocks that only a command (an abort,
                # an import's commit or end) frees. Sleep until one comes instead of spinning.
                self._wake.wait(0.05)
                self._wake.clear()

    def _run_commands(self) -> None:
        while True:
            try:
                fn, future, loop = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                result = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                if future is not None:
                    loop.call_soon_threadsafe(_set_exception, future, exc)
                continue
            if future is not None:
                loop.call_soon_threadsafe(_set_result, future, result)

    def _fail_all(self, exc: Exception) -> list[RequestOutput]:
        outputs = []
        for rid in list(self.engine.requests):
            self.engine.abort(rid, reason="error")
        for out in self.engine.step():
            out.error = f"engine error: {exc}"
            outputs.append(out)
        return outputs

    def _deliver(self, out: RequestOutput) -> None:
        entry = self._streams.get(out.request_id)
        if entry is None:
            return
        loop, stream = entry
        loop.call_soon_threadsafe(stream.put_nowait, out)


class KVImportHandle:
    """A decode-only request whose KV is arriving; write it, then decode or abort.

    Writes are queued for the engine thread without waiting for them: waiting would cost the
    transfer up to one engine step per frame while the engine decodes other requests. The queue
    is FIFO, so every write runs before the commit, and a write's error surfaces at the next
    write or at `decode`, before any token is produced from incomplete KV.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, *, cached_tokens: int = 0) -> None:
        self._engine = engine
        self.request_id = request_id
        self.cached_tokens = cached_tokens  # leading prompt tokens decode already held (not needed)
        self._writes: list[asyncio.Future] = []

    async def write(self, chunk: LayerKVChunk) -> None:
        self._raise_failed_writes()
        self._writes.append(self._engine._submit(lambda: self._engine.engine.write_kv(self.request_id, chunk)))

    def _raise_failed_writes(self) -> None:
        pending = []
        for future in self._writes:
            if future.done():
                future.result()  # raises the write's error
            else:
                pending.append(future)
        self._writes = pending

    async def decode(self, first_token_id: int) -> AsyncIterator[RequestOutput]:
        eng = self._engine
        writes, self._writes = self._writes, []
        await asyncio.gather(*writes)  # every write has run; the first error, if any, is raised here
        stream = eng._open_stream(self.request_id)
        try:
            await eng._call(lambda: eng.engine.commit_import(self.request_id, first_token_id))
        except BaseException:
            eng._streams.pop(self.request_id, None)
            raise
        async for out in eng._drain(self.request_id, stream):
            yield out

    async def abort(self) -> None:
        writes, self._writes = self._writes, []
        await asyncio.gather(*writes, return_exceptions=True)  # retrieve their errors: the request is gone
        await self._engine.abort(self.request_id)


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
