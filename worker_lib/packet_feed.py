"""Rows of a packet array that a helper thread makes ready while the transport's engine sends them.

A DDP step used to quantize a whole bucket (7 ms of a 4.19 M-coordinate bucket on one core) before its
first packet left; the network then waited for the codec and the codec for nothing. With a feed, the
codec's compiled pass (which releases the GIL) runs on a helper thread in pieces and publishes how many
rows are final after each piece; the engine (``Transport._exchange``) sends every row that is ready and
wakes on the feed's pipe when it has nothing else to do. The bytes sent are the same.

Why a pipe and not a ``threading.Event``: the engine sleeps in ``select`` on its sockets, and the pipe's
read end is one more file descriptor there, so an answer and a new piece wake it alike.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

#: ``work(publish)``: fills the rows in order and calls ``publish(rows)`` each time rows 0..rows-1 are final.
FeedWork = Callable[[Callable[[int], None]], None]


class PacketFeed:
    """``work`` run on a helper thread for the duration of a ``with`` block; ``ready`` rows of ``rows`` are final
    so far."""

    def __init__(self, rows: int, work: FeedWork) -> None:
        self.rows = rows
        self.ready = 0
        self.error: BaseException | None = None
        self._work = work
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        self._thread = threading.Thread(target=self._run, name="thc-feed", daemon=True)

    def __enter__(self) -> PacketFeed:
        """Start the work."""
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_exc: object) -> None:
        """Wait for the work to end (it may run after its last row; if the engine failed first, it runs to its
        end all the same), release the pipe, and raise the work's exception where the engine raised none."""
        self._thread.join()
        os.close(self._read)
        os.close(self._write)
        if exc_type is None:
            self.check()

    def fileno(self) -> int:
        """The pipe's read end: readable when rows were published or the work ended (``select``)."""
        return self._read

    def _publish(self, rows: int) -> None:
        if not self.ready <= rows <= self.rows:
            raise ValueError(f"published {rows} rows after {self.ready}, of {self.rows}")
        self.ready = rows
        os.write(self._write, b"r")

    def _run(self) -> None:
        try:
            self._work(self._publish)
            if self.ready != self.rows:
                raise RuntimeError(f"the packet feed ended with {self.ready} of {self.rows} rows ready")
        except BaseException as e:  # handed to the engine's thread (``check``)
            self.error = e
        finally:
            os.write(self._write, b"e")

    def drain(self) -> None:
        """Empty the pipe (after ``select`` found it readable) and raise the work's exception, if it failed."""
        try:
            while os.read(self._read, 4096):
                pass
        except BlockingIOError:
            pass
        self.check()

    def check(self) -> None:
        """Raise the work's exception, if it failed."""
        if self.error is not None:
            raise self.error
