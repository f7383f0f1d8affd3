"""benchmarks/plot.py as a user runs it: the --json output of ztier-bench nvme,
pcie, adam and step (shapes and number formats of real runs on this project's
machine, trimmed to a few rows) becomes readable PNG files, one per input,
whose paths it prints; an input that is not a ztier-bench JSON, or lacks what
its plot needs, is refused with the reason and exit code 2, writing nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PLOT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "plot.py")

# The last line of `ztier-bench <cmd> --json`, as printed (trimmed).
NVME = (
    '{"bench":"nvme","backend":"io_uring","read_bytes_per_s":2.37453e+09,'
    '"write_bytes_per_s":1.64131e+09,"read_bytes_per_s_checksums":2.34067e+09,'
    '"write_bytes_per_s_checksums":1.95943e+09,"fio_engine":"io_uring",'
    '"fio_read_bytes_per_s":1.93119e+09,"fio_write_bytes_per_s":2.42928e+09,'
    '"read_ratio_to_fio":1.22957,"write_ratio_to_fio":0.675638,'
    '"backends":[{"backend":"io_uring","read_bytes_per_s":2.37453e+09,'
    '"write_bytes_per_s":1.64131e+09,"read_bytes_per_s_checksums":2.34067e+09,'
    '"write_bytes_per_s_checksums":1.95943e+09,"read_ratio_to_fio":1.22957,'
    '"write_ratio_to_fio":0.675638}],"paths":["/tmp/zb-nvme"],"stripe_bytes":1048576,'
    '"queue_depth":16,"total_bytes":1073741824,"checksums":"off (headline); on in *_checksums",'
    '"qd_sweep":[{"queue_depth":1,"write_bytes_per_s":1.41143e+09,'
    '"read_bytes_per_s":1.83371e+09},{"queue_depth":4,"write_bytes_per_s":1.65188e+09,'
    '"read_bytes_per_s":1.48159e+09},{"queue_depth":16,"write_bytes_per_s":1.57181e+09,'
    '"read_bytes_per_s":1.44675e+09},{"queue_depth":64,"write_bytes_per_s":1.15809e+09,'
    '"read_bytes_per_s":1.74722e+09}]}')

PCIE = (
    '{"bench":"pcie","backend":"host","device":"host","statistic":"median","reps":5,'
    '"max_size":67108864,"limit":"memcpy same size, same buffers","h2d_gbps":11.7887,'
    '"h2d_ratio":1.07661,"d2h_gbps":10.8269,"d2h_ratio":0.886433,"both_gbps":14.8644,'
    '"both_ratio":0.995241,"sizes":[{"bytes":65536,"copies_per_round":256,"h2d_gbps":38.4571,'
    '"h2d_limit_gbps":48.8961,"h2d_ratio":0.786507,"d2h_gbps":39.8447,"d2h_limit_gbps":49.1313,'
    '"d2h_ratio":0.810984,"both_gbps":67.8712,"both_limit_gbps":91.0328,"both_ratio":0.745568},'
    '{"bytes":262144,"copies_per_round":64,"h2d_gbps":41.1412,"h2d_limit_gbps":48.2942,'
    '"h2d_ratio":0.851887,"d2h_gbps":40.1522,"d2h_limit_gbps":48.3415,"d2h_ratio":0.830595,'
    '"both_gbps":67.2607,"both_limit_gbps":94.8254,"both_ratio":0.709312},{"bytes":67108864,'
    '"copies_per_round":1,"h2d_gbps":11.7887,"h2d_limit_gbps":10.9499,"h2d_ratio":1.07661,'
    '"d2h_gbps":10.8269,"d2h_limit_gbps":12.214,"d2h_ratio":0.886433,"both_gbps":14.8644,'
    '"both_limit_gbps":14.9355,"both_ratio":0.995241}]}')

ADAM = (
    '{"params":67108864,"threads":2,"grad":"bf16","out":"bf16","state_dtype":"fp32",'
    '"store":"stream","check":"prechecked","seconds":0.0277764,"params_per_s":2.41604e+09,'
    '"bytes_per_param":28,"bytes_per_s":6.76491e+10,"limit_seconds":0.0254589,'
    '"limit_bytes_per_s":7.38071e+10,"ratio_to_limit":0.916568,"bench":"adam",'
    '"target":"AVX3_DL","cases":[{"params":16777216,"threads":1,"grad":"bf16","out":"bf16",'
    '"state_dtype":"fp32","store":"stream","check":"prechecked","seconds":0.0169332,'
    '"params_per_s":9.90789e+08,"bytes_per_param":28,"bytes_per_s":2.77421e+10,'
    '"limit_seconds":0.0162427,"limit_bytes_per_s":2.89215e+10,"ratio_to_limit":0.959221},'
    '{"params":16777216,"threads":2,"grad":"bf16","out":"bf16","state_dtype":"fp32",'
    '"store":"stream","check":"prechecked","seconds":0.00977571,"params_per_s":1.71621e+09,'
    '"bytes_per_param":28,"bytes_per_s":4.8054e+10,"limit_seconds":0.00979366,'
    '"limit_bytes_per_s":4.79659e+10,"ratio_to_limit":1.00184},{"params":67108864,"threads":1,'
    '"grad":"bf16","out":"bf16","state_dtype":"fp32","store":"stream","check":"prechecked",'
    '"seconds":0.0527554,"params_per_s":1.27208e+09,"bytes_per_param":28,'
    '"bytes_per_s":3.56181e+10,"limit_seconds":0.047472,"limit_bytes_per_s":3.95823e+10,'
    '"ratio_to_limit":0.89985},{"params":67108864,"threads":2,"grad":"bf16","out":"bf16",'
    '"state_dtype":"fp32","store":"stream","check":"prechecked","seconds":0.0277764,'
    '"params_per_s":2.41604e+09,"bytes_per_param":28,"bytes_per_s":6.76491e+10,'
    '"limit_seconds":0.0254589,"limit_bytes_per_s":7.38071e+10,"ratio_to_limit":0.916568}]}')

STEP = (
    '{"bench":"step","tier":"nvme","param_tier":"nvme","state_dtype":"fp32","params":67108864,'
    '"units":3,"state_bytes":805306368,"buffer_count":4,"paths":["/tmp/zb-step"],"threads":0,'
    '"checksums":true,"overlap_efficiency":1.20072,"step_seconds":0.67605,'
    '"io_alone_seconds":0.811746,"compute_alone_seconds":0.107676,'
    '"params_per_second":9.92661e+07,"peak_rss_bytes":829800448,"pinned_pool_bytes":671096832,'
    '"ring_bytes":536870912,"scratch_bytes":134217728,"nvme_read_bytes":2415919104,'
    '"nvme_write_bytes":2818572288,"nvme_read_bytes_per_step":805306368,'
    '"nvme_write_bytes_per_step":939524096,"steps":[{"step_seconds":0.67605,'
    '"io_alone_seconds":0.811746,"compute_alone_seconds":0.107676,'
    '"compute_in_step_seconds":0.111932,"io_wait_in_step_seconds":0.55439,'
    '"overlap_efficiency":1.20072}],"timeline":{"step":3,"step_seconds":0.742193,'
    '"write_backs_done_seconds":0.742195,'
    '"times":"seconds from the step\'s start (its last grads handed over)","note":"",'
    '"units":[{"unit":0,"params":8388608,"read_start":-0.00760506,"read_end":0.0637281,'
    '"compute_start":0.0667405,"compute_end":0.0750963,"write_start":0.155654,'
    '"write_end":0.202019,"read_bytes":100663296,"write_bytes":117440512},{"unit":1,'
    '"params":8388608,"read_start":0.0573315,"read_end":0.110313,"compute_start":0.112412,'
    '"compute_end":0.121231,"write_start":0.24594,"write_end":0.309166,"read_bytes":100663296,'
    '"write_bytes":117440512},{"unit":2,"params":8388608,"read_start":0.103763,'
    '"read_end":0.161592,"compute_start":0.203031,"compute_end":0.214776,'
    '"write_start":0.380459,"write_end":0.419223,"read_bytes":100663296,'
    '"write_bytes":117440512}]}}')

STEP_DRAM = (
    '{"bench":"step","tier":"dram","param_tier":"dram","state_dtype":"fp32","params":67108864,'
    '"units":2,"state_bytes":805306368,"buffer_count":4,"paths":[],"threads":0,'
    '"checksums":true,"overlap_efficiency":0.981907,"step_seconds":0.118483,'
    '"io_alone_seconds":0,"compute_alone_seconds":0.11652,"params_per_second":5.66402e+08,'
    '"peak_rss_bytes":1466630144,"pinned_pool_bytes":1073750016,"ring_bytes":0,'
    '"scratch_bytes":134217728,"nvme_read_bytes":0,"nvme_write_bytes":0,'
    '"nvme_read_bytes_per_step":0,"nvme_write_bytes_per_step":0,'
    '"steps":[{"step_seconds":0.0991964,"io_alone_seconds":0,"compute_alone_seconds":0.0964715,'
    '"compute_in_step_seconds":0.0791749,"io_wait_in_step_seconds":0,'
    '"overlap_efficiency":0.97253}],"timeline":{"step":4,"step_seconds":0.150891,'
    '"write_backs_done_seconds":0.150895,'
    '"times":"seconds from the step\'s start (its last grads handed over)","note":"",'
    '"units":[{"unit":0,"params":8388608,"compute_start":0.00346266,"compute_end":0.0289835},'
    '{"unit":1,"params":8388608,"compute_start":0.0324149,"compute_end":0.0591651}]}}')


def run(*args):
    return subprocess.run([sys.executable, PLOT, *map(str, args)], capture_output=True,
                          text=True, timeout=300)


def check_png(path):
    """A PNG that Pillow (matplotlib's own dependency) decodes, of a readable size."""
    from PIL import Image

    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n", path
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        width, height = image.size
    assert 600 <= width <= 1600 and 300 <= height <= 1600, (path, width, height)
    assert os.path.getsize(path) < 200_000, path


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture(autouse=True)
def _matplotlib():
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (scripts/python_env.sh)")


def both_runs():
    """ztier-bench step --state-dtype both: fp32 then int8 under "runs"."""
    fp32 = json.loads(STEP)
    int8 = dict(fp32, state_dtype="int8")
    return json.dumps({"bench": "step", "int8_over_fp32_step": 0.984, "runs": [fp32, int8]})


@pytest.mark.parametrize("name, text, suffix", [
    ("nvme.json", NVME, "queue-depth"),
    ("pcie.json", PCIE, "transfer-size"),
    ("adam.json", ADAM, "threads"),
    ("step.json", STEP, "timeline"),
    ("step-dram.json", STEP_DRAM, "timeline"),
], ids=["nvme", "pcie", "adam", "step-nvme", "step-dram"])
def test_each_kind_makes_a_png(tmp_path, name, text, suffix):
    out = tmp_path / "plots"
    p = run(write(tmp_path, name, text + "\n"), "--out", out)
    assert p.returncode == 0, p.stderr
    want = out / f"{name.removesuffix('.json')}-{suffix}.png"
    assert p.stdout.split() == [str(want)]
    check_png(want)


def test_whole_outputs_and_several_inputs(tmp_path):
    # The whole output of a run (the table, then the JSON line), several at once.
    nvme = write(tmp_path, "nvme.txt", "ztier-bench nvme: 1 path(s), 1G total\n"
                 "  qd   1  write   1.411 GB/s  read   1.834 GB/s\n" + NVME + "\n")
    adam = write(tmp_path, "adam.txt", "ztier-bench adam: SIMD target AVX3_DL\n" + ADAM + "\n")
    pcie = json.loads(PCIE)
    for row in pcie["sizes"]:  # one thread count, and a cuda run: the peak is the limit
        row.update({k: v * 10 for k, v in row.items() if k.endswith("_gbps")})
    pcie.update(backend="cuda", device="NVIDIA H200", limit="pinned cudaMemcpyAsync peak",
                peak_bytes=268435456, peak_h2d_gbps=55.1, peak_d2h_gbps=55.6,
                peak_both_gbps=100.2)
    cuda = write(tmp_path, "cuda.json", json.dumps(pcie))
    one_thread = json.loads(ADAM)
    one_thread["cases"] = [c for c in one_thread["cases"] if c["threads"] == 1]
    sizes = write(tmp_path, "adam1.json", json.dumps(one_thread))
    both = write(tmp_path, "both.json", both_runs())
    p = run(nvme, adam, cuda, sizes, both, "--out", tmp_path)
    assert p.returncode == 0, p.stderr
    names = [os.path.basename(line) for line in p.stdout.split()]
    assert names == ["nvme-queue-depth.png", "adam-threads.png", "cuda-transfer-size.png",
                     "adam1-params.png", "both-timeline.png"]
    for name in names:
        check_png(tmp_path / name)


@pytest.mark.parametrize("text, reason", [
    ("ztier-bench nvme: 1 path(s)\nnothing else\n", "no JSON object"),
    ("[1, 2, 3]\n", "without a 'bench' field"),
    ('{"read_bytes_per_s": 1e9}\n', "without a 'bench' field"),
    ('{"bench":"rpc","p50_us":26.0}\n', "ztier-bench rpc has no plot"),
    ('{"bench":"nvme","queue_depth":16}\n', "without 'qd_sweep'"),
    ('{"bench":"pcie","backend":"host","sizes":[]}\n', "'sizes' is empty"),
    ('{"bench":"adam","cases":[{"params":"16M"}]}\n', "no number 'params'"),
    ('{"bench":"step","overlap_efficiency":0.97}\n', "no 'timeline'"),
    ("", "no JSON object"),
], ids=["text", "a-list", "no-bench", "rpc", "no-sweep", "no-sizes", "bad-case", "no-timeline",
        "empty"])
def test_bad_input_is_refused_with_the_reason(tmp_path, text, reason):
    bad = write(tmp_path, "bad.json", text)
    good = write(tmp_path, "nvme.json", NVME)
    out = tmp_path / "plots"
    p = run(good, bad, "--out", out)
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert str(bad) in p.stderr and reason in p.stderr, p.stderr
    assert p.stdout == ""
    assert not out.exists() or not list(out.iterdir())  # nothing written, the good one neither


def test_missing_file_and_usage(tmp_path):
    p = run(tmp_path / "missing.json", "--out", tmp_path)
    assert p.returncode == 2 and "missing.json" in p.stderr and "cannot read" in p.stderr
    p = run(write(tmp_path, "nvme.json", NVME))  # no --out
    assert p.returncode == 2 and "--out" in p.stderr
