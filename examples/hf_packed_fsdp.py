"""Packed long-context training, on CPU: torchrun --nproc-per-node 2 examples/hf_packed_fsdp.py"""
import gc

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from upipe.integrations import hf

dist.init_process_group("gloo")  # CPU ranks; GPUs: "nccl", set_device, model and data .cuda()
torch.manual_seed(0)  # the same weights and data on every rank
config = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256,
                     num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2)
model = LlamaForCausalLM(config)
hf.parallelize(model, "upipe", group=dist.group.WORLD, stack="alst")  # + the memory stack


def fsdp2(model):  # FSDP2 over the CP ranks (here also the only data ranks)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)  # lm_head stays in the root unit (the chunked loss reads its weight)
    for unit in (m for m in model.modules() if isinstance(m, FSDPModule)):
        unit.set_gradient_divide_factor(1.0)  # each rank holds a share of one loss: sum it
        unit.set_force_sum_reduction_for_comms(True)  # as a plain SUM (gloo has no PREMUL_SUM)


fsdp2(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model.train()  # checkpointing (and its offload) act in training mode
doc_lens = [700, 1, 300, 1047]  # packed documents: one 2048-token sequence
input_ids = torch.randint(0, config.vocab_size, (1, sum(doc_lens)))
position_ids = torch.cat([torch.arange(n) for n in doc_lens])[None]  # restart at 0 per document
for step in range(3):
    batch = hf.shard_batch(model, input_ids, position_ids=position_ids)  # + cu_seq_lens_q/_k
    out = model(**batch)  # attention and labels never cross a document; no full logits
    out.loss.backward()  # this rank's token-loss sum / the batch's token count
    opt.step()
    opt.zero_grad()
    loss = out.loss.detach()
    dist.all_reduce(loss)  # the mean token loss over all documents
    if dist.get_rank() == 0:
        print(f"step {step}: loss {loss.item():.4f}")
del model, out, opt  # they hold the process group; FSDP2's state and the module it shards
gc.collect()  # reference each other (torch 2.13's FSDP2 device mesh still keeps gloo's threads)
dist.destroy_process_group()
