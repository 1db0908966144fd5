"""Write an FP8 block-scaled copy (DeepSeek-V3 / Kimi K2 format: `weight` float8_e4m3fn, `weight_scale_inv`
per 128x128 block, `quantization_config.quant_method = "fp8"`) of a dense checkpoint's decoder linear layers,
to run and `hearth eval` the FP8-weight paths on the demo model:

    python scripts/convert_fp8_block.py --src models/demo --out /tmp/demo-fp8
    hearth eval --model models/demo ... --config fp8w:model=/tmp/demo-fp8 --config fp8w-int4:model=/tmp/demo-fp8,quantization=int4

Embeddings, norms and the LM head stay as they are (DeepSeek-V3 ships those in BF16).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from hearth.model.quantization.fp8_block import quantize_fp8_blocks

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--src", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--block", type=int, default=128)
    args = parser.parse_args()
    src, out = Path(args.src), Path(args.out)
    shutil.copytree(src, out, dirs_exist_ok=True)
    tensors = {}
    dense_bytes = fp8_bytes = 0
    for path in sorted(src.glob("*.safetensors")):
        for name, tensor in load_file(path).items():
            if name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEARS:
                weight, scale_inv = quantize_fp8_blocks(tensor, (args.block, args.block))
                tensors[name] = weight
                tensors[name.removesuffix("weight") + "weight_scale_inv"] = scale_inv
                dense_bytes += tensor.numel() * tensor.element_size()
                fp8_bytes += weight.numel() + scale_inv.numel() * 4
            else:
                tensors[name] = tensor
        (out / path.name).unlink()
    save_file(tensors, out / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [args.block, args.block],
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    print(f"linear layers: {dense_bytes / 1e6:.2f} MB -> {fp8_bytes / 1e6:.2f} MB FP8 + scales; wrote {out}")


if __name__ == "__main__":
    main()
