"""optim=muon: Muon for the blocks' weight matrices, fused AdamW for every other parameter, one optimizer.

Muon (Jordan et al. 2024, "Muon: an optimizer for hidden layers in neural networks") runs SGD with
Nesterov momentum and replaces each matrix's update by an approximately orthogonal matrix of the
same shape (all singular values near 1), computed by a few steps of an odd matrix polynomial, the
Newton-Schulz iteration. For a matrix parameter W (r x c) with gradient G, each step:

    B <- mu * B + (1 - mu) * G                  momentum (mu = optim.muon_momentum)
    U <- (1 - mu) * G + mu * B                  Nesterov
    O <- orthogonalize(U)                       per part: the q, k and v rows of the fused projection
                                                (and SwiGLU's gate and up rows) are matrices of their own
    W <- W - lr * wd * W                        decoupled weight decay (optim.muon_weight_decay); with
                                                optim.muon_cautious only where O and W have one sign
    W <- W - lr * scale(r, c) * O               scale: shape = sqrt(max(1, r / c)) (Jordan), or
                                                rms = 0.2 * sqrt(max(r, c)) (Moonshot: AdamW's update RMS)

orthogonalize(X): transpose a tall X, divide by its Frobenius norm (every singular value <= 1), then
X <- a X + b (X X^T) X + c (X X^T)^2 X for each (a, b, c) of the chosen coefficients:
``polar_express`` (Amsel et al. 2025, five tuned steps; modded-nanogpt's) or ``jordan`` (3.4445,
-4.7750, 2.0315, five times; torch.optim.Muon's). On a GPU the iteration runs in bf16 on every matrix
of one shape at once (a batched matmul); elsewhere the same, in the parameters' dtype.

Why not torch.optim.Muon (PyTorch >= 2.9): its step reads the learning rate on the host and takes
no gradient scale or skip flag, so it can be neither captured in a CUDA graph (trainer.cuda_graph)
nor told to clip or skip a step on the device as our fused AdamW is (training/optim.py); it
orthogonalises the fused q/k/v projection as one matrix; and its one (a, b, c) cannot express Polar
Express. With ``jordan``, the shape scale, plain decay and one matrix per parameter it computes our
update (tests/test_muon.py checks this). docs/RECIPE.md says more.
"""
from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Tuple

import torch

# Polar Express (Amsel, Persson, Musco, Gower 2025, arXiv:2505.16932): the coefficients modded-nanogpt
# uses, computed for 5 steps with safety factor 2e-2 and cushion 2; the input's norm is inflated by
# that factor first.
POLAR_EXPRESS = ((8.156554524902461, -22.48329292557795, 15.878769915207462),
                 (4.042929935166739, -2.808917465908714, 0.5000178451051316),
                 (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                 (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                 (2.3465413258596377, -1.7097828382687081, 0.42323551169305323))
JORDAN = ((3.4445, -4.7750, 2.0315),) * 5  # Keller Jordan's quintic, maximal slope at zero; torch.optim.Muon's
COEFFICIENTS = {"polar_express": POLAR_EXPRESS, "jordan": JORDAN}
LR_SCALES = ("shape", "rms")


def orthogonalize(x: torch.Tensor, coefficients: str, dtype: torch.dtype) -> torch.Tensor:
    """The Newton-Schulz iteration of ``coefficients`` on x: (r, c) or a stack (n, r, c), computed in
    ``dtype``: a matrix of x's shape with x's singular vectors and singular values near 1.

    The input is divided by its Frobenius norm, an upper bound of its largest singular value: times
    1.02, plus 1e-6, for Polar Express (its safety factor); at least 1e-7 for Jordan's, as torch does.
    """
    tall = x.shape[-2] > x.shape[-1]
    x = x.to(dtype)
    if tall:
        x = x.mT
    norm = x.norm(dim=(-2, -1), keepdim=True)
    x = x / (norm * 1.02 + 1e-6) if coefficients == "polar_express" else x / norm.clamp(min=1e-7)
    addmm = torch.baddbmm if x.dim() == 3 else torch.addmm
    for a, b, c in COEFFICIENTS[coefficients]:
        gram = x @ x.mT
        x = addmm(x, addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)  # a x + (b G + c G^2) x
    return x.mT if tall else x


def lr_scale(rows: int, cols: int, kind: str) -> float:
    """How much a (rows x cols) matrix's step is scaled against optim.muon_lr (see the module docstring)."""
    if kind == "shape":
        return max(1.0, rows / cols) ** 0.5
    return 0.2 * max(rows, cols) ** 0.5


def parts(matrix: torch.Tensor, row_splits: Optional[Sequence[int]]) -> Tuple[torch.Tensor, ...]:
    """The separate matrices stacked in ``matrix``'s rows (views), or the whole matrix."""
    return (matrix,) if row_splits is None else matrix.split(list(row_splits), dim=0)


class MuonAdamW(torch.optim.AdamW):
    """One optimizer: Muon for the groups marked ``muon=True``, fused AdamW for the others.

    A Muon group holds ``momentum``, ``coefficients`` (polar_express | jordan), ``lr_scale_kind``
    (shape | rms), ``cautious`` and ``row_splits`` (how each of its matrices' rows split into parts,
    or None). Like fused AdamW, a step divides the gradients by ``self.grad_scale`` when it is set
    (clipping, training/optim.py: clip_in_step) and changes nothing when ``self.found_inf`` is 1, all
    on the device; the learning rate may be a device tensor (make_capturable). So the step can be
    captured in a CUDA graph, and the fp16 grad scaler drives it as it drives AdamW. The state of a
    Muon matrix is its momentum buffer, saved and loaded with the rest.
    """

    def __setstate__(self, state: dict) -> None:
        """(load_state_dict calls it.) AdamW's checks of its state look at its own groups only."""
        groups = state["param_groups"]
        super().__setstate__({**state, "param_groups": [group for group in groups if not group["muon"]]})
        self.param_groups = groups

    def step(self):
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        with torch.no_grad():
            self._muon_step(grad_scale, found_inf)
        groups = self.param_groups
        self.param_groups = [group for group in groups if not group["muon"]]  # AdamW steps its own groups
        try:
            super().step()
        finally:
            self.param_groups = groups

    def _muon_step(self, grad_scale: Optional[torch.Tensor], found_inf: Optional[torch.Tensor]) -> None:
        """Momentum, then every part's orthogonalized update (parts of one shape together), then the weights."""
        updates: List[Tuple[dict, torch.Tensor, torch.Tensor]] = []  # (group, part of a weight, its momentum update)
        for group in self.param_groups:
            if not group["muon"]:
                continue
            for p in group["params"]:
                if p.grad is not None:
                    nesterov = self._momentum(p, group["momentum"], grad_scale, found_inf)
                    updates += [(group, w, u) for w, u in zip(parts(p, group["row_splits"]),
                                                              parts(nesterov, group["row_splits"]))]
        by_shape: Dict[tuple, List[int]] = defaultdict(list)
        for i, (group, _, u) in enumerate(updates):
            by_shape[(u.shape, u.device, u.dtype, group["coefficients"])].append(i)
        for (_, device, dtype, coefficients), indices in by_shape.items():
            # one batched iteration for every matrix of this shape: in bf16 on a GPU, else in the weights' dtype
            stacked = torch.stack([updates[i][2] for i in indices])
            orthogonal = orthogonalize(stacked, coefficients, torch.bfloat16 if device.type == "cuda" else dtype)
            for i, o in zip(indices, orthogonal.unbind(0)):
                group, weight, _ = updates[i]
                self._apply(weight, o.to(weight.dtype), group, found_inf)

    def _momentum(self, p: torch.Tensor, momentum: float, grad_scale, found_inf) -> torch.Tensor:
        """Update p's momentum buffer with its (unscaled, clipped) gradient; the Nesterov direction.
        A skipped step (found_inf = 1) reads a zero gradient and leaves the buffer as it was."""
        grad = p.grad if grad_scale is None else p.grad / grad_scale.to(p.grad.dtype)
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        if found_inf is None:
            buf.lerp_(grad, 1 - momentum)
        else:
            keep = 1 - found_inf.to(p.dtype)
            grad = torch.where(keep > 0, grad, 0)
            buf.lerp_(grad, (1 - momentum) * keep)
        return grad.lerp(buf, momentum)

    @staticmethod
    def _apply(weight: torch.Tensor, o: torch.Tensor, group: dict, found_inf: Optional[torch.Tensor]) -> None:
        """weight -= decay, then lr * scale * o; nothing moves when found_inf is 1."""
        lr = group["lr"] if found_inf is None else group["lr"] * (1 - found_inf.to(weight.dtype))
        decay = lr * group["weight_decay"]
        if group["weight_decay"] and group["cautious"]:
            weight.sub_(weight * (o * weight >= 0) * decay)
        elif group["weight_decay"]:
            weight.mul_(1 - decay)
        weight.sub_(o * (lr * lr_scale(*weight.shape, group["lr_scale_kind"])))
