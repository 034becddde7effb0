"""A weight sync that goes wrong on its way, injected from the tests: Python loads this module at start-up in every
process that has this folder on PYTHONPATH (a stage's driver and, with a private Ray cluster, its workers). With
RLHF_TEST_SYNC_FAULT=<scale|drop>:<tensor name> set, the tensor is doubled or left out where an engine opens the
actor's shared buckets (stages.rl.weight_sync.open_shared), after the actor digested it. Nothing in the product knows
about it."""

from __future__ import annotations

import importlib.abc
import os
import sys

_FAULT = os.environ.get("RLHF_TEST_SYNC_FAULT")
_MODULE = "stages.rl.weight_sync"


def _altered(open_shared, kind: str, target: str):
    def open_shared_on_a_bad_day(shared, bucket, device):
        for name, tensor in open_shared(shared, bucket, device):
            if name != target:
                yield name, tensor
            elif kind == "scale":
                yield name, tensor * 2
    return open_shared_on_a_bad_day


class _AlterOnImport(importlib.abc.MetaPathFinder):
    """Finds the weight-sync module as the other finders do, and alters its `open_shared` once it has run."""

    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        run = spec.loader.exec_module
        kind, target_name = _FAULT.split(":", 1)

        def exec_module(module):
            run(module)
            module.open_shared = _altered(module.open_shared, kind, target_name)

        spec.loader.exec_module = exec_module
        return spec


if _FAULT:
    sys.meta_path.insert(0, _AlterOnImport())
