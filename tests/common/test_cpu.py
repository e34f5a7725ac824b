"""common/cpu.py: the CPU identity recorded beside every benchmark figure."""
from __future__ import annotations

import platform

from eagle_deploy.common.cpu import ISA_FLAGS, cpu_info

ZEN3 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx fma avx2 bmi2 sha_ni vaes

processor\t: 1
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
flags\t\t: fpu avx2 avx512f avx512_bf16
"""

XEON = """processor\t: 0
model name\t: Intel(R) Xeon(R) Processor
cpu family\t: 6
model\t\t: 143
flags\t\t: fpu avx2 fma avx512f avx512_vnni avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8
bugs\t\t: spectre_v1
"""


def test_an_avx2_only_cpu_is_named_with_its_isa_from_its_first_processor_only():
    info = cpu_info(ZEN3)
    assert (info.model, info.family, info.model_id) == ("AMD EPYC", 25, 1)
    assert info.isa == ["avx2", "fma"] and not info.native_bf16  # processor 1's flags are not read
    assert info.to_json() == {"cpu_model": "AMD EPYC", "cpu_family": 25, "cpu_model_id": 1, "isa": ["avx2", "fma"],
                              "cpu_count": info.cores}


def test_native_bf16_and_the_isa_order_on_a_xeon():
    info = cpu_info(XEON)
    assert info.native_bf16 and info.model_id == 143
    assert info.isa == ["avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16",
                        "amx_int8", "amx_tile"] == [f for f in ISA_FLAGS if f in info.flags]
    assert "spectre_v1" not in info.flags  # "bugs" is not "flags"
    assert not cpu_info("flags\t: fpu avx2 avx512f avx512_vnni\nbugs\t: avx512_bf16\n").native_bf16


def test_without_cpuinfo_the_platform_names_the_cpu_and_nothing_is_guessed():
    info = cpu_info("")
    assert info.model == (platform.processor() or platform.machine()) and info.model
    assert (info.family, info.model_id, info.isa, info.native_bf16) == (None, None, [], False)
    assert cpu_info("model name\t: X\ncpu family\t: ?\n").family is None


def test_this_machine_is_read():
    info = cpu_info()
    assert info.model and info.cores and info.cores >= 1


def test_the_machine_record_holds_this_cpu_and_the_threads():
    from eagle_deploy.common.cpu import machine_record

    record = machine_record(3)
    assert record["threads"] == 3 and record["platform"] == platform.platform()
    assert {k: record[k] for k in cpu_info().to_json()} == cpu_info().to_json()
