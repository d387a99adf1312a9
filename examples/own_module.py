"""UPipe in your own model, on CPU: torchrun --nproc-per-node 2 examples/own_module.py"""
import torch
import torch.distributed as dist

from upipe import LlamaAttention, UPipeAttention

dist.init_process_group("gloo")  # CPU ranks; GPUs: "nccl", set_device, model and data .cuda()
torch.manual_seed(0)  # the same weights and data on every rank
ref = LlamaAttention(dim=256, n_heads=8, n_kv_heads=2)  # single-device Llama attention
attn = UPipeAttention(dim=256, n_heads=8, n_kv_heads=2, group=dist.group.WORLD, heads_per_stage=4)
attn.load_state_dict(ref.state_dict())  # the same wq/wk/wv/wo
x = torch.randn(1, 1024, 256)  # the full sequence...
y_local = attn(attn.shard(x))  # ...of which each rank runs its part: (1, 1024 / CP, 256)
y_local.sum().backward()  # attn's weight gradients: this rank's share (sum them over ranks)
torch.testing.assert_close(attn.unshard(y_local), ref(x), rtol=1e-4, atol=1e-5)
print(f"rank {dist.get_rank()}: UPipe output equals the reference, y_local {tuple(y_local.shape)}")
del attn, y_local  # both hold the process group (y_local through its autograd graph); freeing
dist.destroy_process_group()  # them lets this end it and join gloo's threads before Python exits
