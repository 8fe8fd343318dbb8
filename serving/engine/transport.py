"""The one inter-process mechanism between the engine and the front end, used in both directions:
a plain pipe of length-prefixed pickles.

Not a multiprocessing Connection, whose `send` blocks while the pipe is full: the front end's
loop writes its commands without ever blocking, and keeps what does not fit until the pipe drains
(`PipeWriter.attach`). The engine's thread writes its outputs blocking (a writer never attached),
as it has nothing else to do until the front end reads them."""

from __future__ import annotations

import asyncio
import os
import pickle
import select
import struct
import time

_LENGTH = struct.Struct("!Q")  # a message's frame: its pickle's length, then the pickle


def message_pipe() -> tuple[PipeReader, PipeWriter]:
    """One direction: a pipe of length-prefixed pickles, (its reading end, its writing end)."""
    read_fd, write_fd = os.pipe()
    return PipeReader(read_fd), PipeWriter(write_fd)


class _PipeEnd:
    """One end of a message pipe: its descriptor, closed once (-1 after)."""

    def __init__(self, fd: int):
        self.fd = fd

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class PipeReader(_PipeEnd):
    """The reading end: `poll` and `recv` as a Connection's (EOFError once the writer has gone).
    `recv` reads a whole message, waiting for the rest of one that has begun to arrive."""

    def __init__(self, fd: int):
        super().__init__(fd)
        # poll, not select: select refuses a descriptor numbered 1024 or more, and the engine
        # runs in the caller's process, which may hold that many files. (A poll object holds no
        # descriptor of its own: it works on in a forked child.)
        self._poller = select.poll()
        self._poller.register(fd, select.POLLIN)

    def poll(self) -> bool:
        """A message (or the end of the pipe) is there to read."""
        return bool(self._poller.poll(0))

    def recv(self) -> object:
        (length,) = _LENGTH.unpack(self._read(_LENGTH.size))
        return pickle.loads(self._read(length))

    def _read(self, n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            chunk = os.read(self.fd, n - len(data))
            if not chunk:
                raise EOFError("the writer closed its end of the pipe")
            data += chunk
        return bytes(data)


class PipeWriter(_PipeEnd):
    """The writing end. Until `attach`, `send` writes the whole frame and may block (the engine's
    thread, always; the front end's start-up error, before its loop runs), and raises OSError once
    the reader has gone. Once attached to a loop, `send` writes what the pipe takes now and leaves
    the rest to the loop's writer callback, in order; after the reader has gone it drops messages
    (`on_gone` was told)."""

    def __init__(self, fd: int):
        super().__init__(fd)
        self._unsent = bytearray()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_gone = None
        self._waiting = False  # a writer callback is registered for what is unsent

    def attach(self, loop: asyncio.AbstractEventLoop, on_gone) -> None:
        """From now on never block; `on_gone()` (on the loop) once the reader's end has closed."""
        os.set_blocking(self.fd, False)
        self._loop = loop
        self._on_gone = on_gone

    def detach(self) -> None:
        """Back to blocking writes: the loop has ended (what is unsent goes first)."""
        if self.fd >= 0:
            os.set_blocking(self.fd, True)
        self._loop = None

    def send(self, message: object) -> None:
        if self.fd < 0:
            if self._loop is None:
                raise OSError("the pipe is closed")
            return  # the reader has gone (on_gone was told): nobody reads any more
        data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        self._unsent += _LENGTH.pack(len(data)) + data
        if self._loop is None:  # not attached: all of it, now
            try:
                while self._unsent:
                    del self._unsent[:os.write(self.fd, self._unsent)]
            except OSError:  # the reader has gone: no half frame stays to be sent after it
                self._unsent.clear()
                raise
        elif not self._waiting:
            self._write()

    def _write(self) -> None:
        try:
            del self._unsent[:os.write(self.fd, self._unsent)]
        except BlockingIOError:  # the pipe is full: the reader is busy (the engine reads between steps)
            pass
        except OSError:  # the reader's process has gone
            self._unsent.clear()
            self._wait_writable(False)
            self.close()
            self._on_gone()
            return
        self._wait_writable(bool(self._unsent))

    def _wait_writable(self, wait: bool) -> None:
        if wait == self._waiting:
            return
        if wait:
            self._loop.add_writer(self.fd, self._write)
        else:
            self._loop.remove_writer(self.fd)
        self._waiting = wait

    def flush(self, timeout: float, outputs: PipeReader, on_output) -> None:
        """Write what is unsent, for at most `timeout` seconds, handing whatever arrives on
        `outputs` meanwhile to `on_output()` (an engine blocked writing its outputs to a front end
        that has stopped reading would never read this)."""
        deadline = time.monotonic() + timeout
        poller = select.poll()
        poller.register(outputs.fileno(), select.POLLIN)
        poller.register(self.fd, select.POLLOUT)
        while self._unsent and self.fd >= 0 and (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(left * 1000))
            if outputs.fileno() in ready:
                on_output()
            if self.fd in ready:
                self._write()
