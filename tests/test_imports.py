"""The GPU machines we benchmark on may lack datasets, wandb, jsonargparse and llvmlite: the module, the loss,
the callbacks and context parallelism must import without them."""

import subprocess
import sys


def test_module_loss_and_callbacks_do_not_import_datasets_wandb_jsonargparse_or_llvmlite():
    code = (
        "import sys, lit_memtrain.objectives.causal_lm, lit_memtrain.techniques.loss, lit_memtrain.callbacks, lit_memtrain.parallel.context_parallel;"
        "import lit_memtrain.objectives.dpo, lit_memtrain.techniques.logprobs;"
        "print(sorted(m for m in ('datasets', 'wandb', 'jsonargparse', 'llvmlite') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
