"""Delete one transfer from a plan file, as a careless hand edit would, for the docs' example.

    python docs/examples/drop_transfer.py PLAN.json EDITED.json [ROUND MESSAGE TRANSFER]

The indices (default 0 1 0) count from 0: the round, the message in it, the transfer in that
message. The plan's ``dynatrain verify`` then names the elements nobody writes any more.
"""

import json
import sys


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 5):
        print(__doc__.strip().split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        plan = json.load(f)
    r, m, t = (int(x) for x in argv[2:]) if len(argv) == 5 else (0, 1, 0)
    message = plan["rounds"][r][m]
    dropped = message["transfers"].pop(t)
    with open(argv[1], "w", encoding="utf-8") as f:
        json.dump(plan, f)
    print(f"dropped {dropped[0]} {dropped[1]} from {message['src_device']} -> "
          f"{message['dst_device']} in round {r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
