#!/usr/bin/env python3
"""Compare two Megatron-LM ``torch_dist`` checkpoints tensor by tensor, bit for bit:

    python scripts/compare_checkpoints.py ck_k/iter_0000008 ck_r/iter_0000008

Prints one JSON object (equal, tensors, only_in_a, only_in_b, differing); exit 0 if equal,
1 if not. No process group needed: each checkpoint is read whole in this process."""

import json
import sys

from megatron_deadpool.adapters.checkpoints import compare


def main(argv) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    result = compare(argv[0], argv[1])
    print(json.dumps(result, indent=1))
    return 0 if result["equal"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
