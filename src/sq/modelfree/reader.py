"""Model-free reads: checkpoint tensors by positional reads, converted to what the model path holds, and a
read-ahead thread that overlaps reading with quantizing (``sq.modelfree``)."""

from __future__ import annotations

import logging
import math
import queue
import re
import threading

import torch

from sq.errors import SqError
from sq.load import fp8
from sq.load.fill import data_start, pread_into
from sq.load.source import open_checked
from sq.modelfree.plan import Unit, fp32_patterns

logger = logging.getLogger(__name__)

class Reader:
    """Checkpoint tensors by positional reads (``os.preadv`` into a tensor's own memory), converted
    to what the model path holds: the config's dtype (float32 where transformers keeps a module in
    float32), FP8 block-scaled weights dequantized per tile.

    Why not ``safe_open``: a plain read releases the GIL while the disk works, so the read-ahead
    thread (``ReadAhead``) truly overlaps reading with quantizing, and a row range or one expert
    of a fused tensor reads exactly its bytes.  ``fetch`` only reads (the thread's half);
    ``convert`` only computes (the caller's).  Safe to use from two threads."""

    def __init__(self, source, layout, dtype: torch.dtype):
        self.source, self.layout, self.dtype = source, layout, dtype
        self.files: dict[str, tuple] = {}  # file -> (open file, start of its data section)
        self.lock = threading.Lock()
        self.bytes_read = 0  # what this rank asked the files for (the report's, beside the prediction)
        fp32 = fp32_patterns(source.config, dtype)
        self.fp32 = re.compile("|".join(re.escape(p) for p in fp32)) if fp32 else None

    def _file(self, name: str) -> tuple[int, int]:
        """(fd, start of the data section) of ``name``, opened once under the loader's link rule."""
        with self.lock:
            if name not in self.files:
                path = self.source.path(name)
                f = open_checked(path.parent, path.name)
                try:
                    start = data_start(f.fileno(), path)
                except OSError:
                    f.close()
                    raise SqError(f"{path} is shorter than a safetensors header") from None
                self.files[name] = (f, start)
            f, start = self.files[name]
            return f.fileno(), start

    def close(self) -> None:
        with self.lock:
            for f, _ in self.files.values():
                f.close()
            self.files.clear()

    def read(self, key: str, lo: int = 0, hi: int | None = None, e: int | None = None) -> torch.Tensor:
        """``key`` as stored: whole, or rows ``[lo, hi)`` of its first dimension, or of expert ``e``'s
        rows of a fused 3-D tensor (rows of a C-contiguous tensor are one byte range: only it is read)."""
        info = self.source.tensors[key]
        fd, data = self._file(info.file)
        if e is None and lo == 0 and hi is None:
            first, shape = 0, info.shape
            nbytes = info.nbytes
        else:
            rows, inner = (info.shape[0], info.shape[1:]) if e is None else (info.shape[1], info.shape[2:])
            hi = rows if hi is None else hi
            row_bytes = info.dtype.itemsize * math.prod(inner)
            first, shape, nbytes = ((e or 0) * rows + lo) * row_bytes, (hi - lo, *inner), (hi - lo) * row_bytes
        buf = torch.empty(nbytes, dtype=torch.uint8)
        with self.lock:
            self.bytes_read += nbytes
        path = self.source.path(info.file)
        try:
            pread_into(fd, buf, data + info.offsets[0] + first, path)
        except EOFError:
            raise SqError(f"{path} ends inside tensor {key}: the file is truncated") from None
        return buf.view(info.dtype).reshape(shape)

    def fetch(self, key: str, lo: int = 0, hi: int | None = None, e: int | None = None):
        """What ``convert`` needs for these rows: (rows as stored, their FP8 scale rows or None)."""
        raw = self.read(key, lo, hi, e)
        if e is not None or self.layout is None or key not in self.layout.scales:
            return raw, None
        br = self.layout.block[0]
        return raw, self.read(self.layout.scales[key], lo // br, -(-(lo + len(raw)) // br))

    def fetch_unit(self, unit: Unit) -> list:
        return [self.fetch(s.key, s.lo, s.hi, s.e) for s in unit.slots]

    def convert(self, key: str, fetched, lo: int = 0, expert: bool = False, cast: bool = True) -> torch.Tensor:
        """Fetched rows from row ``lo`` in the model's dtype (``cast``; else as stored, FP8 dequantized:
        carried tensors); ``expert``: rows of a fused experts tensor (never float32, never FP8-scaled)."""
        t, scale = fetched
        if scale is not None:
            out = torch.empty(t.shape, dtype=self.dtype)
            br = self.layout.block[0]
            fp8.dequantize_into(out, t, scale, (lo - lo // br * br, 0), self.layout.block)
            return out
        if not (cast and t.is_floating_point()):
            return t
        if expert or self.fp32 is None or not self.fp32.search(key):
            return t.to(self.dtype)
        return t.to(torch.float32)

    def converted_itemsize(self, key: str, expert: bool = False) -> int:
        """The bytes an element of ``key`` takes once ``convert`` has it (the memory and disk predictions)."""
        info = self.source.tensors[key]
        if self.layout is not None and key in self.layout.scales and not expert:
            return self.dtype.itemsize
        if not info.dtype.is_floating_point:
            return info.dtype.itemsize
        if expert or self.fp32 is None or not self.fp32.search(key):
            return self.dtype.itemsize
        return 4

    def specs(self, keys, cast: bool = True) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Each of ``keys``' dtype and shape as ``weight`` makes it (the header of a file written streamed)."""
        out = {}
        for k in keys:
            info = self.source.tensors[k]
            scaled = self.layout is not None and k in self.layout.scales
            if scaled or (cast and info.dtype.is_floating_point):
                size = self.converted_itemsize(k)
                dtype = self.dtype if scaled or size == self.dtype.itemsize else torch.float32
            else:
                dtype = info.dtype
            out[k] = (dtype, tuple(info.shape))
        return out

    def weight(self, key: str, cast: bool = True) -> torch.Tensor:
        return self.convert(key, self.fetch(key), cast=cast)


class ReadAhead:
    """This rank's units' tensors read by a background thread, at most ``depth`` units ahead of the
    one being quantized, handed out in order by ``get``.

    Why: the disk reads the next units while the CPU quantizes this one, so a rank runs at the
    pace of the slower of the two instead of their sum.  ``depth`` bounds the memory (the unit being
    quantized and ``depth`` read ones).  An exception in the thread is raised, as it is, by the
    ``get`` of the unit it happened on."""

    def __init__(self, reader: Reader, units: list[Unit], depth: int = 2):
        self.q: queue.Queue = queue.Queue()
        self.room = threading.Semaphore(depth)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(reader, units), name="sq-read-ahead", daemon=True)
        self.thread.start()

    def _run(self, reader: Reader, units: list[Unit]) -> None:
        for u in units:
            self.room.acquire()
            if self.stop.is_set():
                return
            try:
                self.q.put((reader.fetch_unit(u), None))
            except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
                self.q.put((None, e))
                return

    def get(self) -> list:
        """The next unit's fetched slots; the previous unit's place is free for one more read."""
        fetched, error = self.q.get()
        self.room.release()
        if error is not None:
            raise error
        return fetched

    def close(self) -> None:
        self.stop.set()
        self.room.release()  # a thread waiting for room wakes and sees the stop
        self.thread.join()

