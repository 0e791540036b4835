"""studies/perturb.py: the perturbations behind the trainer's --init-perturbation and
--grad-perturbation flags (the convergence study's fp32 yardsticks), and that the trainer imports
them only when one of the flags is set. The flags end to end: tests/test_compare_convergence.py."""
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from studies import perturb  # noqa: E402


def test_perturb_init_nudges_weights_by_the_asked_relative_amount():
    """Each weight moves by rel * z with z standard normal: the relative changes over ~17k weights
    have mean ~0 and std ~rel; zeros stay zero; the same seed gives bit-identical weights, another
    seed other ones; rel 0 changes nothing; torch's global RNG is left where it was."""
    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.LayerNorm(128))
    torch.nn.init.zeros_(net[0].bias)
    start = {k: v.clone() for k, v in net.state_dict().items()}
    rng = torch.get_rng_state()
    assert perturb.perturb_init(net, 0.0, 1) == 0.0
    assert all(torch.equal(v, start[k]) for k, v in net.state_dict().items())
    largest = perturb.perturb_init(net, 1e-3, 1)
    assert torch.equal(torch.get_rng_state(), rng)
    after = {k: v.clone() for k, v in net.state_dict().items()}
    assert torch.equal(after["0.bias"], start["0.bias"])  # zeros stay zero
    rel = torch.cat([(after[k].double() / start[k].double() - 1).flatten() for k in ("0.weight", "1.weight")]) / 1e-3
    assert rel.numel() == 128 * 128 + 128
    assert abs(rel.mean().item()) < 0.03 and rel.std().item() == pytest.approx(1.0, rel=0.03)
    assert largest == pytest.approx(1e-3 * rel.abs().max().item(), rel=1e-3)
    net.load_state_dict(start)
    perturb.perturb_init(net, 1e-3, 1)
    assert all(torch.equal(v, after[k]) for k, v in net.state_dict().items())
    net.load_state_dict(start)
    perturb.perturb_init(net, 1e-3, 2)
    assert not torch.equal(net.state_dict()["0.weight"], after["0.weight"])


def test_perturb_grads_nudges_every_gradient_alike_on_every_rank():
    """Each gradient moves by rel * z: relative changes with mean ~0 and std ~rel; two generators
    with one seed (two ranks) give bit-identical gradients; parameters without a gradient are skipped."""
    torch.manual_seed(5)
    net = torch.nn.Sequential(torch.nn.Linear(96, 96), torch.nn.Linear(96, 96, bias=False), torch.nn.Linear(96, 2))
    net(torch.randn(8, 96)).square().sum().backward()
    net[2].weight.grad = None
    start = [None if p.grad is None else p.grad.clone() for p in net.parameters()]
    perturb.perturb_grads(net, 1e-3, torch.Generator().manual_seed(1))
    after = [None if p.grad is None else p.grad.clone() for p in net.parameters()]
    assert after[3] is None
    rel = torch.cat([(a.double() / s.double() - 1).flatten() for a, s in zip(after, start) if a is not None]) / 1e-3
    assert rel.numel() == 2 * 96 * 96 + 96 + 2
    assert abs(rel.mean().item()) < 0.03 and rel.std().item() == pytest.approx(1.0, rel=0.03)
    for p, s in zip(net.parameters(), start):
        p.grad = None if s is None else s.clone()
    perturb.perturb_grads(net, 1e-3, torch.Generator().manual_seed(1))
    assert all((p.grad is None and a is None) or torch.equal(p.grad, a) for p, a in zip(net.parameters(), after))


def test_trainer_imports_the_perturbations_only_when_asked():
    """``scripts/train.py`` without a perturbation flag does not load the studies' module; with one
    it finds it from any working directory."""
    code = ("import sys; sys.path.insert(0, {scripts!r}); import train; "
            "assert not any(m == 'studies' or m.startswith('studies.') for m in sys.modules), sorted(sys.modules); "
            "p = train.perturbations(); assert p.__file__ == {path!r}, p.__file__")
    code = code.format(scripts=os.path.join(REPO, "scripts"), path=os.path.join(REPO, "studies", "perturb.py"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(REPO), env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:]
