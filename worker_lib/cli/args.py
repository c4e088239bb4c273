"""Argument types shared by the command-line tools."""

from __future__ import annotations

import argparse
import socket
from collections.abc import Callable
from typing import TypeVar

from worker_lib.thc.table import parse_fraction

T = TypeVar("T")

#: The floating-point types a gradient may have on the command lines (``--dtype``), by torch's names: the
#: torch type is ``getattr(torch, name)`` (this module stays free of torch, which the light CLIs skip).
FLOAT_DTYPES = ("bfloat16", "float16", "float32")
#: THC's rotations on the command lines (``--rotation``): ``worker_lib.thc.codec.Rotation``'s values, here
#: for the same reason.
ROTATIONS = ("per-step", "fixed")
#: The DDP hook's rotation with error feedback unless one is asked for (``DDPHookConfig.rotation``): one
#: rotation per bucket, whose error feedback stays rotated, one transform per step cheaper than the paper's
#: per-step signs and as accurate in the trainings measured (docs/ddp.md, "A fixed rotation").
DDP_ROTATION = "fixed"


#: The longest vector the benchmark commands (``thc-bench``) take, and the most worker-coordinates of one
#: run: every simulated worker holds its own codec buffers, about 10 bytes per coordinate, so 2^28 of them
#: is some 2.5 GiB; beyond, a run ends in an allocation failure rather than a result.
MAX_BENCH_DIM = 1 << 26
MAX_BENCH_COORDINATES = 1 << 28
#: Seeds go to numpy and torch generators, which take unsigned 32-bit (and wider) values.
MAX_SEED = (1 << 32) - 1


def check_bench_size(workers: int, dim: int) -> None:
    """Refuse (ValueError, one line) a run whose workers' buffers would not fit a workstation's memory."""
    if workers * dim > MAX_BENCH_COORDINATES:
        raise ValueError(f"--workers {workers} x --dim {dim} = {workers * dim:,} coordinates, more than "
                         f"{MAX_BENCH_COORDINATES:,} (about 2.5 GiB of buffers): reduce one of them")


def fraction(text: str) -> float:
    """Parse a probability written as a decimal (0.03125) or a fraction (1/32)."""
    try:
        return parse_fraction(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse type: an integer (decimal or 0x hex) in lo..hi, else one clear line."""

    def parse(text: str) -> int:
        try:
            value = int(text, 0)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be in {lo}..{hi}, got {value}")
        return value

    parse.__name__ = f"integer in {lo}..{hi}"
    return parse


def int_or_auto(lo: int, hi: int) -> Callable[[str], int | None]:
    """An argparse type: ``auto`` (returned as None: the program chooses) or an integer in lo..hi."""
    number = int_in(lo, hi)

    def parse(text: str) -> int | None:
        return None if text.strip().lower() == "auto" else number(text)

    return parse


def float_in(lo: float, hi: float) -> Callable[[str], float]:
    """An argparse type: a finite number in lo..hi, else one clear line."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be in {lo:g}..{hi:g}, got {text}")
        return value

    parse.__name__ = f"number in {lo:g}..{hi:g}"
    return parse


#: A TCP or UDP port; 0 asks the kernel for a free one.
port_number = int_in(0, 65535)


def host_port(text: str) -> tuple[str, int]:
    """An argparse type: ``HOST:PORT`` (HOST may be empty: 127.0.0.1; else ``ipv4_host``) with a port in
    1..65535."""
    host, sep, port = text.rpartition(":")
    try:
        num = int(port)
    except ValueError:
        num = -1
    if not sep or not 1 <= num <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT with a port in 1..65535, got {text!r}")
    return ipv4_host(host or "127.0.0.1"), num


def ipv4_host(text: str) -> str:
    """An argparse type: an IPv4 address or a name that resolves to one (the wire is IPv4: checked when the
    option is read, not where a socket or a forked worker first uses it)."""
    try:
        socket.gethostbyname(text)
    except (OSError, UnicodeError):
        raise argparse.ArgumentTypeError(f"{text!r} is not an IPv4 address or a name that resolves to one") from None
    return text


def log_level(text: str) -> str:
    """An argparse type: a logging level name (DEBUG, INFO, WARNING, ERROR, CRITICAL)."""
    names = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
    if text.upper() not in names:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(names)}, got {text!r}")
    return text.upper()


def comma_list(item: Callable[[str], T], example: str) -> Callable[[str], list[T]]:
    """An argparse type: distinct comma-separated values, each parsed by the argparse type ``item`` (whose
    message names the first bad one); ``example`` shows the form in the message for a malformed list."""

    def parse(text: str) -> list[T]:
        out: list[T] = []
        for part in text.split(","):
            if not part.strip():
                raise argparse.ArgumentTypeError(f"expected a comma-separated list like {example}, got {text!r}")
            value = item(part.strip())
            if value in out:
                raise argparse.ArgumentTypeError(f"{part.strip()} given twice")
            out.append(value)
        return out

    parse.__name__ = "comma-separated list"
    return parse
