"""Model families behind one small interface; `get_family(name)` picks one."""

from __future__ import annotations

from engine.families.base import Family


def get_family(name: str) -> Family:
    if name == "causal_lm":
        from engine.families.causal_lm import CausalLM

        return CausalLM()
    if name == "flux":
        from engine.families.image.flux import Flux  # added by the Flux family

        return Flux()
    if name == "flux2":
        from engine.families.image.flux2 import Flux2

        return Flux2()
    if name == "qwen_image":
        from engine.families.image.qwen_image import QwenImage

        return QwenImage()
    if name == "z_image":
        from engine.families.image.z_image import ZImage

        return ZImage()
    if name == "chroma":
        from engine.families.image.chroma import Chroma

        return Chroma()
    if name == "flux3":
        from engine.families.image.flux3 import Flux3

        return Flux3()
    if name == "krea2":
        from engine.families.image.krea2 import Krea2

        return Krea2()
    if name == "wan":
        from engine.families.video.wan import Wan

        return Wan()
    if name == "hunyuan_video":
        from engine.families.video.hunyuan_video import HunyuanVideo

        return HunyuanVideo()
    raise ValueError(f"unknown model family {name!r}")
