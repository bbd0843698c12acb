"""ms per training step of the n-body Clifford model compiled on the GPU (batch 100, AdamW), the step
`nbody-clifford-34k` trains; `nbody_long.sh` runs six at once to pick the budget that fits."""

import time

import torch

from geoattn.tasks.nbody import CliffordGNNConfig, NBodyCliffordGNN

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = NBodyCliffordGNN(CliffordGNNConfig()).to(device)
step_model = torch.compile(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(100, 5, 7, device=device), torch.randn(100, 5, 3, device=device)


def step() -> None:
    _, loss = step_model(x, y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


start = time.perf_counter()
for _ in range(20):
    step()
torch.cuda.synchronize() if device.type == "cuda" else None
print(f"compile_s {time.perf_counter() - start:.1f}")
steps = 300 if device.type == "cuda" else 10
start = time.perf_counter()
for _ in range(steps):
    step()
torch.cuda.synchronize() if device.type == "cuda" else None
print(f"ms_per_step {(time.perf_counter() - start) / steps * 1e3:.2f}")
