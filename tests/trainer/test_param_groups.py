"""The trainer's AdamW hyperparameters per param group: Megatron's groups mark 1-D parameters
(norm weights) with wd_mult 0, which only Megatron's OptimizerParamScheduler multiplies in; the
trainer runs its own schedule, so it must apply it; and a checkpoint load must not bring back the
writer's weight decay and betas over the recipe's."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = r"""
import os, sys
import torch, torch.distributed as dist


def build(overrides):
    from megamoe_trainer.model import build_model
    from megamoe_trainer.recipe import load_recipe
    small = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.ffn_hidden_size=128",
             "model.seq_length=32", "moe.ffn_hidden_size=64", "train.micro_batch_size=2", "parallel.world_size=1",
             "parallel.expert_parallel=1", "train.lr=0.1"]
    recipe = load_recipe(os.path.join(sys.argv[1], "recipes", "tiny_moe_cpu.yaml"), small + overrides)
    model, optimizer, _ = build_model(recipe, "cpu")
    return recipe, model, optimizer


def main():
    from megamoe_trainer.cli import quiet
    quiet()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3])
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megamoe_trainer import checkpoint as ckpt
    from megamoe_trainer.recipe import load_recipe
    from megamoe_trainer.rank_setup import init_parallel
    from megamoe_trainer.step import set_lr, set_recipe_hyperparams

    run = sys.argv[2]
    init_parallel(load_recipe(os.path.join(sys.argv[1], "recipes", "tiny_moe_cpu.yaml"),
                              ["parallel.world_size=1", "parallel.expert_parallel=1"]), "cpu")
    recipe, model, optimizer = build(["train.weight_decay=0.5"])
    set_recipe_hyperparams(optimizer, recipe)
    set_lr(optimizer, 0.1)
    # a step with zero gradients: Adam's update is 0, only the decoupled weight decay moves weights
    before = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    model.zero_grad_buffer()
    optimizer.zero_grad()
    for p in model.parameters():
        p.main_grad.zero_()
    optimizer.step()
    for n, p in model.named_parameters():
        changed = not torch.equal(p.detach().float(), before[n])
        assert changed == (p.dim() > 1), (n, tuple(p.shape), changed)  # norm weights: no decay

    # a checkpoint written with weight decay 0.5 and beta2 0.95, resumed with 0.1 and 0.9
    ckpt.save_checkpoint(run, 1, 2, model, optimizer, "cpu", {})
    recipe2, model2, optimizer2 = build(["train.weight_decay=0.1", "train.adam_beta2=0.9"])
    ckpt.load_checkpoint(ckpt.latest_checkpoint(run), model2, optimizer2, "cpu")
    set_recipe_hyperparams(optimizer2, recipe2)
    for group in optimizer2.param_groups:
        assert group["betas"] == (0.9, 0.9), group["betas"]
        assert group["weight_decay"] == 0.1 * group["wd_mult"], (group["weight_decay"], group["wd_mult"])
    assert {g["wd_mult"] for g in optimizer2.param_groups} == {0.0, 1.0}
    print("param groups ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""


def test_no_weight_decay_on_norms_and_recipe_hyperparams_after_a_load(tmp_path):
    from megamoe_train.launch import free_port

    script = tmp_path / "groups.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, str(script), ROOT, str(tmp_path / "run"), str(free_port())],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and "param groups ok" in proc.stdout, proc.stdout + proc.stderr[-4000:]
