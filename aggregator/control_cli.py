"""``thc-control``: send one command to a running ``thc-aggregator``'s control socket and print the reply."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from aggregator.control import REFUSED, ControlAddress, ControlConfigError, read_token, send_command
from worker_lib.cli.args import float_in


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="thc-control",
        description="Drive a running thc-aggregator started with --control: add or remove jobs, list them "
                    "(keys left out), read the counter totals.",
        epilog="Examples: thc-control /tmp/thc.sock list; thc-control 127.0.0.1:9500 stats; "
               "thc-control --token-file tok /tmp/thc.sock add 'job=2,key=0x1234,workers=8'; "
               "thc-control /tmp/thc.sock remove 2")
    p.add_argument("address", help="the aggregator's --control: a Unix socket PATH or HOST:PORT")
    p.add_argument("command", nargs="+", help="add SPEC | remove ID | list | stats")
    p.add_argument("--token-file", type=Path, help="the file given to thc-aggregator --control-token-file")
    p.add_argument("--timeout", type=float_in(0.01, 600), default=3.0, help="seconds to wait for the reply")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        address = ControlAddress.parse(args.address)
        token = read_token(args.token_file) if args.token_file else None
        reply = send_command(address, " ".join(args.command), token=token, timeout=args.timeout)
    except ControlConfigError as exc:
        print(f"thc-control: {exc}", file=sys.stderr)
        return 2
    except TimeoutError:
        print(f"thc-control: no reply from {args.address} within {args.timeout:g} s (is thc-aggregator running "
              "with this --control, and does it want a token?)", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"thc-control: cannot reach {args.address}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    if REFUSED.startswith(reply) and reply:
        print("thc-control: the aggregator refused the command: bad or missing token (--token-file)",
              file=sys.stderr)
        return 1
    print(reply)
    return 1 if reply.startswith("error:") else 0


if __name__ == "__main__":
    sys.exit(main())
