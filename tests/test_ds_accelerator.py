"""``megazero.deepspeed.accelerator.get_accelerator()``: DeepSpeed's accelerator names for the device
megazero trains on (the CPU here), and a missing method named in one line."""
import pytest
import torch

from megazero.deepspeed.accelerator import get_accelerator


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU accelerator")
def test_the_cpu_accelerator_answers_what_deepspeed_examples_ask():
    acc = get_accelerator()
    assert acc.device_name() == "cpu" and acc.device_name(3) == "cpu"  # as DeepSpeed's CPU accelerator
    assert acc.device(0) == torch.device("cpu") and acc.current_device_name() == "cpu"
    assert acc.is_available() and acc.device_count() == 1
    assert acc.communication_backend_name() == "gloo"
    assert acc.is_bf16_supported() and acc.is_fp16_supported()
    x = torch.ones(3)
    assert acc.on_accelerator(x) and acc.pin_memory(x) is x and not acc.is_pinned(x)
    acc.manual_seed(5)
    a = torch.rand(2)
    acc.set_rng_state(acc.get_rng_state())
    acc.manual_seed(5)
    assert torch.equal(a, torch.rand(2))
    acc.synchronize()
    acc.empty_cache()
    assert acc.memory_allocated() == 0 and acc.total_memory() > 2 ** 30


def test_a_method_it_lacks_is_one_line_naming_it():
    with pytest.raises(AttributeError) as err:
        get_accelerator().create_graph()
    msg = str(err.value)
    assert "\n" not in msg and "create_graph" in msg and "device_name" in msg


def test_reachable_as_deepspeeds_module():
    import megazero.deepspeed as deepspeed
    assert deepspeed.accelerator.get_accelerator().device_name() in ("cpu", "cuda")
