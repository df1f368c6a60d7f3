"""Recovery mechanisms: abort, world formation and rebuild, rebind and its audit, restore
decision, the reaper, stalls, fault points. Sequenced by ``control/runtime.py``."""
