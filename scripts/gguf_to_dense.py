"""Write a GGUF file's weights as a dense Hugging Face checkpoint directory (float32 safetensors, config,
tokenizer), dequantized by transformers: the float reference the quality tables compare quantized
configurations with (docs/quantization.md).

    python scripts/gguf_to_dense.py --gguf $(python -c "from hearth.model.named_models import NAMED_MODELS; \
        print(NAMED_MODELS['smollm2'].path())") --out /tmp/smollm2-dense
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gguf", required=True, help="a GGUF file")
    parser.add_argument("--out", required=True, help="the directory to write")
    args = parser.parse_args()
    path = Path(args.gguf)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    model.config.quantization_config = None  # the weights written are dense
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    print(f"{path.name} -> {args.out} (dense float32)")


if __name__ == "__main__":
    main()
