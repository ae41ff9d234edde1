"""`python -m fastrlhf.integrations check`: for the installed peers, what patch() would replace and
whether the FASTRLHF_PATCH switch is active (fastrlhf.integrations.switch.check). Exit status 1 when
patch() fails for an installed peer."""

import argparse
import sys

from fastrlhf.integrations.switch import check
from fastrlhf_hook import PEERS

parser = argparse.ArgumentParser(prog="python -m fastrlhf.integrations")
parser.add_argument("command", choices=["check"], help="check: what patch() replaces, and whether the switch is on")
parser.add_argument("peers", nargs="*", metavar="PEER", help=f"some of {', '.join(PEERS)} (default: all)")
args = parser.parse_args()
if any(p not in PEERS for p in args.peers):
    parser.error(f"argument PEER: expected some of {', '.join(PEERS)}; got {' '.join(args.peers)}")
sys.exit(1 if check(tuple(args.peers) or PEERS) else 0)
