"""Wan 2.1 / 2.2 Loader node: the schema; loading is host/wan_loader.py."""

from __future__ import annotations

from comfy_api.latest import io

from ..checkpoints import wan as wc
from ..host.files import file_fingerprint
from ..host.names import CATEGORY_LOADERS, display_name, node_id
from ..host.seams import DISABLE
from ..host.model_loading import COMPUTE
from ..host.wan_loader import QUANTIZATION, check_decoding_vae, load_wan_model


class WanLoader(io.ComfyNode):
    """Loads a Wan 2.1 / 2.2 diffusion model (T2V/I2V A14B experts, TI2V 5B), optionally as fp8.

    A loader has no model to pass through: without its seams it is left out (one warning at startup), and
    ComfyUI's UNETLoader remains the way to load the file.
    """

    COMFY_SEAMS = ("folder_paths", "diffusion_model_loading", "ops.custom_operations", "ops.manual_cast",
                   "model_management")
    IF_SEAMS_MISSING = DISABLE
    STRICT_BOOLEANS = ("save_quantized",)  # writes a file: only a real boolean (host/prompt_inputs.py)

    @classmethod
    def define_schema(cls) -> io.Schema:
        import folder_paths

        return io.Schema(
            node_id=node_id("WanLoader"),
            display_name=display_name("Wan 2.2 Loader"),
            category=CATEGORY_LOADERS,
            description=(
                "Loads a Wan 2.1/2.2 diffusion model from diffusion_models as a native MODEL (works with KSampler, "
                "LoRA loaders, Wan conditioning nodes). fp8 quantizes the Linear weights inside the transformer "
                "blocks while reading the file; bf16/fp16/fp32, ComfyUI fp8_scaled, plain fp8 and musubi-tuner fp8 "
                "files are accepted."
            ),
            inputs=[
                io.Combo.Input("unet_name", options=folder_paths.get_filename_list("diffusion_models"),
                               tooltip="Wan diffusion model file (diffusion_models folder)."),
                io.Combo.Input("quantization", options=list(QUANTIZATION), default="fp8 per-tensor",
                               tooltip="none: load as stored. fp8 per-tensor (default): one scale per weight, "
                                       "activations scaled per token; fp8 matmul on Ada, Hopper and Blackwell. "
                                       "fp8 block-wise: one scale per block_size tile; fp8 matmul on Hopper only "
                                       "(dequantized elsewhere), slightly lower error, slightly slower. "
                                       "Already-quantized files keep their own quantization."),
                io.Combo.Input("block_size", options=["128", "64"], default="128",
                               tooltip="Tile size for block-wise fp8. 128 uses the block-scaled fp8 GEMM on "
                                       "H100/H200; 64 stores finer scales but no fp8 GEMM takes them, so those "
                                       "layers dequantize to bf16 (slower)."),
                io.Combo.Input("compute", options=list(COMPUTE), default="auto",
                               tooltip="auto: fp8 matmul where the GPU supports it (RTX 40xx/50xx, H100), int8 "
                                       "matmul on RTX 20xx/30xx and A-series, else dequantize. fp8 matmul: require it "
                                       "(error otherwise). int8 matmul: int8 weights and activations on the int8 "
                                       "tensor cores; pick it on RTX 20xx/30xx/A-series GPUs (what auto does there). "
                                       "dequantize: fp8 storage, bf16 matmul (closest to bf16, slowest)."),
                io.Boolean.Input("save_quantized", default=False,
                                 tooltip="Write the quantized model next to the source file; later loads with the same "
                                         "settings pick it up automatically and skip quantization."),
            ],
            outputs=[io.Model.Output()],
            hidden=[io.Hidden.prompt, io.Hidden.unique_id],
        )

    @classmethod
    def fingerprint_inputs(cls, unet_name: str, quantization: str = "none", block_size: str = "128",
                           **kwargs) -> str:
        """Re-run when the file, or its saved quantized copy, changes on disk under the same name (size/mtime)."""
        import folder_paths

        mode = QUANTIZATION.get(quantization, "none")
        path = folder_paths.get_full_path("diffusion_models", unet_name)
        saved = "none"
        if path and mode != "none" and str(block_size).isdigit():
            try:
                st = wc.quantized_path_for(path, mode, int(block_size)).stat()
                saved = f"{st.st_size}:{st.st_mtime_ns}"
            except OSError:
                pass
        return f"{file_fingerprint('diffusion_models', unet_name)}|{saved}"

    @classmethod
    def execute(cls, unet_name: str, quantization: str, block_size: str, compute: str,
                save_quantized: bool) -> io.NodeOutput:
        import folder_paths

        path = folder_paths.get_full_path_or_raise("diffusion_models", unet_name)
        hidden = getattr(cls, "hidden", None)
        if hidden is not None:
            check_decoding_vae(path, getattr(hidden, "prompt", None), getattr(hidden, "unique_id", None))
        return io.NodeOutput(load_wan_model(path, QUANTIZATION[quantization], int(block_size), COMPUTE[compute],
                                            save_quantized))


NODES = [WanLoader]
