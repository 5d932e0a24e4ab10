"""One rank of a tensor-parallel run: ``torchrun --nproc_per_node N tests/tp_worker.py CKPT
POLICY IDS OUT`` writes ``OUT/rank<r>.json``: the greedy tokens, their logits and the tokens each
of this rank's KV heads holds."""

import json
import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import kvpatch
from kvpatch import compat

checkpoint, policy, prompt, out_dir = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
world = int(os.environ["WORLD_SIZE"])
model = AutoModelForCausalLM.from_pretrained(checkpoint, **compat.tensor_parallel_kwargs(world))
ids = torch.tensor([prompt])
with kvpatch.enabled(model.eval(), policy):
    cache = kvpatch.CompressedDynamicCache(config=model.config)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=6,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        **{compat.cache_argument(model): cache},
    )
result = {
    "rank": dist.get_rank(),
    "tokens": out.sequences[0, ids.shape[1] :].tolist(),
    "logits": torch.stack(out.logits)[:, 0].tolist(),
    "held": [n[0].tolist() for n in cache.physical_lengths()],
}
with open(os.path.join(out_dir, f"rank{result['rank']}.json"), "w") as f:
    json.dump(result, f)
# Once every rank has written its result, leave without tearing anything down: gloo's threads,
# destroyed with the process group or at interpreter exit, can abort a rank now and then
# ("terminate called without an active exception") although its work is done.
dist.barrier()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
