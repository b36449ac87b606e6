"""The held-out sets of this report: the records of
`python -m train prepare --out data/ho-raw --chat 96 --code 32 --math 32 --max-new-tokens 256 --batch-size 80
--temperature 1.0 --top-p 1.0 --greedy-share 0.25 --seed 29 --part-size 80 --no-features`, minus every record
whose prompt is also in the shipped drafter's data (data_release/smollm2's plan), split by the temperature each
record stores: data/t1-text (T = 1) and data/t0-text (greedy). Usage: python make_sets.py data/ho-raw"""

import glob
import gzip
import json
import os
import sys

from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

src = sys.argv[1]
plan = json.load(gzip.open(os.path.join(src, "plan.json.gz")))["prompts"]
trained = {tuple(e["ids"]) for e in json.load(gzip.open("data_release/smollm2/plan.json.gz"))["prompts"]}
sets: dict[float, list[bytes]] = {1.0: [], 0.0: []}
for path in sorted(glob.glob(os.path.join(src, "shard-*.array_record"))):
    reader = ArrayRecordReader(path)
    for raw in reader.read_all():
        rec = json.loads(raw)
        if tuple(plan[rec["index"]]["ids"]) not in trained:
            sets[rec["temperature"]].append(raw)
    reader.close()
for name, t in (("t1-text", 1.0), ("t0-text", 0.0)):
    os.makedirs(f"data/{name}", exist_ok=True)
    writer = ArrayRecordWriter(f"data/{name}/shard-00000-of-00001.array_record", "group_size:1")
    for raw in sets[t]:
        writer.write(raw)
    writer.close()
    tokens = sum(len(json.loads(r)["tokens"]) - json.loads(r)["prompt_len"] for r in sets[t])
    print(f"data/{name}: {len(sets[t])} records, {tokens} response tokens")
