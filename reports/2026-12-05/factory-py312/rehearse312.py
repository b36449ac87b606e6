import json, os, sys, importlib.util, time
sys.path.insert(0, "/work/main")
import jax, flax
print("python", sys.version.split()[0], "jax", jax.__version__, "flax", flax.__version__)
for m in ("grain", "array_record", "torch"):
    try:
        __import__(m); print("WARNING: has", m)
    except ImportError:
        print("absent:", m)
spec = importlib.util.spec_from_file_location("f", "/work/main/scripts/drafter_factory.py")
script = importlib.util.module_from_spec(spec); spec.loader.exec_module(script)
out, dest = "/tmp/reh312/out", "/tmp/reh312/drafters"
t = time.time()
script.main(["run", "--target", "/tmp/factory-model", "--dtype", "float32", "--out", out, "--minutes", "2",
             "--eval-prompts", "/tmp/ep.json.gz", "--kinds", "dspark", "eagle3", "dflash", "--magpie", "12", "--docstrings", "40",
             "--max-query-tokens", "16", "--max-prompt-tokens", "48", "--gen-tokens", "1500",
             "--gen-batch", "16", "--max-new-tokens", "24", "--seq-len", "64", "--batch-sequences", "4",
             "--anchors-per-seq", "4", "--train-steps", "12", "--dspark-layers", "1", "--dflash-layers", "1",
             "--markov-rank", "8", "--heldout-share", "0.25", "--lr", "0.01"])
print("run", round(time.time() - t, 1), "s; files", sorted(os.listdir(out)))
m = json.load(open(os.path.join(out, "metrics.json")))
print("steps", m["train"]["steps"], "response tokens", m["data"]["response_tokens"])
script.main(["assemble", out, dest])
import dspark_jax
from dspark_jax.target import load_target
target = load_target("/tmp/factory-model")
prompts = [[5, 6, 2, 3, 40, 41, 42]]
plain = dspark_jax.generate(target, prompts, max_new_tokens=12, ignore_eos=True).tokens
for kind in ("dspark", "eagle3", "dflash"):
    d = dspark_jax.load_drafter(os.path.join(dest, kind), target)
    spec_ = dspark_jax.generate(target, prompts, drafter=d, max_new_tokens=12, ignore_eos=True).tokens
    print(kind, "greedy speculative == target:", spec_ == plain)
    assert spec_ == plain
print("REHEARSAL OK")
