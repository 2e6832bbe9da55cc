"""Activation of the integrations: one module (deepspeed_async_ckpt/integrations/activation.py)
installs them, the interpreter-start hook (deepspeed_async_ckpt_autoload.py) only calls it,
and no import inside the package leads back to the hook or round in a circle."""

import ast
import os
import subprocess
import sys

from conftest import REPO

PACKAGE = "deepspeed_async_ckpt"
AUTOLOAD = "deepspeed_async_ckpt_autoload"
INTEGRATIONS = os.path.join(REPO, PACKAGE, "integrations")


def _modules() -> dict[str, str]:
    """Dotted name -> path of every module of the integrations package."""
    found = {}
    for root, _, files in os.walk(INTEGRATIONS):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                dotted = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def _imports(module: str, path: str, known: set[str]) -> set[str]:
    """The known modules that ``module`` imports, at its top or inside a function."""
    is_package = path.endswith("__init__.py")
    targets = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = module if is_package else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            base = f"{base}.{node.module}" if node.level and node.module else (base if node.level else node.module)
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            while name:  # importing a.b.c imports a.b and a too
                if name in known:
                    targets.add(name)
                name = name.rpartition(".")[0]
    targets.discard(module)
    return targets


def test_no_module_of_the_integrations_imports_the_autoload_hook_or_forms_a_circle():
    modules = _modules()
    assert {f"{PACKAGE}.integrations.activation", f"{PACKAGE}.integrations.deepspeed.engine",
            f"{PACKAGE}.integrations.hf_trainer.rotation"} <= modules.keys()
    for path in modules.values():  # neither imported nor looked up (sys.modules) by name
        tree = ast.parse(open(path, encoding="utf-8").read())
        named = {alias.name for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                 for alias in node.names} | {node.module for node in ast.walk(tree)
                                             if isinstance(node, ast.ImportFrom)}
        named |= {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)}
        assert AUTOLOAD not in named, path
    graph = {m: _imports(m, p, set(modules)) for m, p in modules.items()}
    done, stack = set(), []

    def visit(module):
        if module in stack:
            raise AssertionError("import circle: " + " -> ".join(stack[stack.index(module):] + [module]))
        if module in done:
            return
        stack.append(module)
        for target in sorted(graph[module]):
            visit(target)
        stack.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def test_every_integration_module_imports_without_the_autoload_hook(repo_env):
    """In a fresh interpreter where importing the hook module fails, every module of the
    integrations imports; activation and the Trainer modules import no framework."""
    names = sorted(_modules())
    probe = ("import sys, importlib\n"
             "sys.modules.pop('deepspeed_async_ckpt_autoload', None)\n"
             "sys.modules['deepspeed_async_ckpt_autoload'] = None  # importing it now raises\n"
             "light = ['deepspeed_async_ckpt.integrations.activation',"
             " 'deepspeed_async_ckpt.integrations.hf_trainer.rotation',"
             " 'deepspeed_async_ckpt.integrations.hf_trainer.trainer_methods']\n"
             "for name in light:\n"
             "    importlib.import_module(name)\n"
             "print(sorted({'torch', 'deepspeed', 'transformers'} & set(sys.modules)))\n"
             f"for name in {names!r}:\n"
             "    importlib.import_module(name)\n"
             "print('imported')\n")
    out = subprocess.run([sys.executable, "-c", probe], env=dict(repo_env, DS_ASYNC_CKPT_AUTOLOAD="0"),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-3:] == ["[]", "imported", ""], out.stdout


def test_the_hook_activates_deepspeed_also_when_the_integration_is_imported_before_it(repo_env):
    """The hook installs the DeepSpeed patches when ``deepspeed.runtime.engine`` is imported,
    here from inside the import of the DeepSpeed integration itself (a script importing the
    engine class before DeepSpeed): the patches are in place, without an error on stderr."""
    probe = ("import sys\n"
             "import deepspeed_async_ckpt_autoload  # what the .pth file does at interpreter start\n"
             "assert 'deepspeed' not in sys.modules\n"
             "from deepspeed_async_ckpt.integrations.deepspeed.engine import AsyncCheckpointEngine\n"
             "import deepspeed.runtime.engine as e\n"
             "from deepspeed_async_ckpt.integrations.deepspeed import patches\n"
             "print(hasattr(e.create_checkpoint_engine, '__wrapped__'), patches.is_installed())\n")
    out = subprocess.run([sys.executable, "-c", probe], env=repo_env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["True", "True"], out.stdout
    assert "auto-activation failed" not in out.stderr, out.stderr[-3000:]
