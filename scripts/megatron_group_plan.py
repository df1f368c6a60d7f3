#!/usr/bin/env python3
"""What a node's loss breaks among megatron-core's own groups, for any layout, with no job:
a thin caller of ``megatron_deadpool.apps.group_plan`` (its docstring has the details).

    python scripts/megatron_group_plan.py --world 99968 --tp 8 --pp 16 [--gpus-per-node 4]
                                          [--lost-node 0]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_deadpool.apps.group_plan import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
