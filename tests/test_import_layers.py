"""What validating a configuration loads: no trainer module (``megazero.training``), in a fresh
interpreter, so that ``validate()`` (every front end's first step) stays light."""
import subprocess
import sys

CODE = """
import sys
from megazero.config import config_from_dict, validate
validate(config_from_dict(dict(mock_data=True, num_layers=2, hidden_size=32, num_attention_heads=4,
                               seq_length=16, vocab_size=100)), 1)
print(" ".join(sorted(m for m in sys.modules if m.startswith("megazero"))))
"""


def test_validate_loads_no_trainer_module():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120,
                         check=True)
    loaded = out.stdout.split()
    assert "megazero.config.validation" in loaded
    assert [m for m in loaded if m.startswith("megazero.training")] == []
