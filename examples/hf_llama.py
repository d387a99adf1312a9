"""UPipe in a Hugging Face model, on CPU: torchrun --nproc-per-node 2 examples/hf_llama.py"""
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from upipe.integrations import hf

dist.init_process_group("gloo")  # CPU ranks; GPUs: "nccl", set_device, model and data .cuda()
torch.manual_seed(0)  # the same weights and data on every rank
config = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512,
                     num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2)
model = LlamaForCausalLM(config)  # or LlamaForCausalLM.from_pretrained(...): weights kept
hf.parallelize(model, "upipe", group=dist.group.WORLD, heads_per_stage=4)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
input_ids = torch.randint(0, config.vocab_size, (1, 2048))  # full sequences, same on every rank
for step in range(3):
    out = model(**hf.shard_batch(model, input_ids))  # this rank's 2048 / CP tokens
    out.loss.backward()  # out.loss: this rank's token-loss sum / the batch's token count
    for p in model.parameters():  # the ranks share one sequence: sum their gradients
        dist.all_reduce(p.grad)
    opt.step()
    opt.zero_grad()
    loss = out.loss.detach()
    dist.all_reduce(loss)  # the full sequence's mean token loss
    if dist.get_rank() == 0:
        print(f"step {step}: loss {loss.item():.4f}")
del model, out  # both hold the process group (out through its autograd graph); freeing them
dist.destroy_process_group()  # lets this end it and join gloo's threads before Python exits
