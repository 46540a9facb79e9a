"""Configs of the other trainers, written for these tests in the shape of each tool's own examples and docs (read, not
copied; the source each follows is named above it), and what each imports to.

Each case: the file's name and text, its dataset file (name, text) or None, the lorad values it must import to
(dotted keys), and the source keys that must be listed as not carried over, exactly. `{root}` is the folder the
test puts the images in: data/ (3 captioned images), kohya/ (kohya's layout: one `10_sks dog` folder, captions
missing), concepts/ (two `N_name` folders), reg/ (class images).
"""

from __future__ import annotations

from tests.engine.importers.configs_sdxl import SDXL_CASES, SDXL_REFUSED

# ---------------------------------------------------------------- ai-toolkit (ostris/ai-toolkit config/examples/)
# the shape of train_lora_flux_24gb.yaml
AI_TOOLKIT_FLUX = """\
---
job: extension
config:
  name: "dog_flux_lora_v1"
  process:
    - type: 'sd_trainer'
      training_folder: "output"
      device: cuda:0
      trigger_word: "p3r5on"
      network:
        type: "lora"
        linear: 16
        linear_alpha: 16
      save:
        dtype: float16
        save_every: 250
        max_step_saves_to_keep: 4
        push_to_hub: false
      datasets:
        - folder_path: "{root}/data"
          caption_ext: "txt"
          caption_dropout_rate: 0.05
          shuffle_tokens: false
          cache_latents_to_disk: true
          resolution: [ 512, 768, 1024 ]
      train:
        batch_size: 1
        steps: 2000
        gradient_accumulation_steps: 1
        train_unet: true
        train_text_encoder: false
        gradient_checkpointing: true
        noise_scheduler: "flowmatch"
        optimizer: "adamw8bit"
        lr: 1e-4
        ema_config:
          use_ema: true
          ema_decay: 0.99
        dtype: bf16
      model:
        name_or_path: "black-forest-labs/FLUX.1-dev"
        is_flux: true
        quantize: true
      sample:
        sampler: "flowmatch"
        sample_every: 250
        sample_start_step: 0
        width: 1024
        height: 1024
        prompts:
          - "[trigger] holding a sign that says 'hello'"
          - "a chess game in the park, [trigger]"
        neg: ""
        seed: 42
        walk_seed: true
        guidance_scale: 4
        sample_steps: 20
meta:
  name: "[name]"
  version: '1.0'
"""

# the shape of train_lora_qwen_image_24gb.yaml, with a LoKr network, a regularisation set and DOP
AI_TOOLKIT_LOKR_DOP = """\
---
job: extension
config:
  name: "person lokr"
  process:
    - type: 'sd_trainer'
      training_folder: "output"
      trigger_word: "ohwx"
      network:
        type: "lokr"
        linear: 32
        linear_alpha: 32
        lokr_factor: 8
        conv: 16
      save:
        save_every: 500
        max_step_saves_to_keep: 2
      datasets:
        - folder_path: "{root}/data"
          caption_ext: "caption"
          num_repeats: 3
          resolution: [ 1024 ]
        - folder_path: "{root}/reg"
          is_reg: true
      train:
        batch_size: 2
        steps: 3000
        lr: 4e-4
        optimizer: "prodigy"
        lr_scheduler: "cosine"
        timestep_type: "shift"
        content_or_style: "balanced"
        dtype: bf16
        diff_output_preservation: true
        diff_output_preservation_class: "person"
        diff_output_preservation_multiplier: 0.5
      model:
        name_or_path: "Qwen/Qwen-Image"
        arch: "qwen_image"
        quantize: true
        qtype: "qfloat8"
      sample:
        sample_every: 0
        prompts: []
"""

# train_lora_chroma_24gb.yaml's shape; dtype, gradient_checkpointing, rank alpha left to ai-toolkit's defaults
AI_TOOLKIT_CHROMA = """\
job: extension
config:
  name: chroma-style
  process:
    - type: sd_trainer
      network: {type: dora, linear: 8}
      save: {save_every: 100}
      datasets:
        - {folder_path: "{root}/data", default_caption: "in the style of xyz", flip_x: true, resolution: 768}
      train: {batch_size: 1, gradient_accumulation_steps: 4, steps: 400, lr: 1e-4, optimizer: AdamW, lr_scheduler: linear,
              timestep_type: linear,
              max_grad_norm: 0.5, seed: 11, train_text_encoder: true}
      model: {name_or_path: lodestones/Chroma1-HD, arch: chroma}
      sample: {sample_every: 100, prompts: ["a house, in the style of xyz"], neg: "low quality", walk_seed: false}
"""

# train_lora_wan22_14b_24gb.yaml's shape: the high-noise expert alone
AI_TOOLKIT_WAN22 = """\
job: extension
config:
  name: "wan22_high"
  process:
    - type: 'sd_trainer'
      device: cuda:0
      trigger_word: "sks"
      network: {type: "lora", linear: 32, linear_alpha: 32}
      save: {dtype: float16, save_every: 250, max_step_saves_to_keep: 4}
      datasets:
        - folder_path: "{root}/data"
          caption_ext: "txt"
          num_frames: 1
          resolution: [ 512 ]
      train:
        batch_size: 1
        steps: 2000
        gradient_accumulation: 1
        gradient_checkpointing: true
        timestep_type: 'linear'
        optimizer: "adamw8bit"
        lr: 1e-4
        optimizer_params:
          weight_decay: 1e-4
        dtype: bf16
        switch_boundary_every: 10
        cache_text_embeddings: true
      model:
        name_or_path: "Wan-AI/Wan2.2-T2V-A14B-Diffusers"
        arch: 'wan22_14b'
        quantize: true
        qtype: "qfloat8"
        model_kwargs:
          train_high_noise: true
          train_low_noise: false
      sample: {sample_every: 250, num_frames: 1, fps: 16, prompts: ["sks walking"], seed: 42, guidance_scale: 3.5}
"""


# ---------------------------------------------------------------- kohya sd-scripts (docs/flux_train_network.md,
# docs/config_README-en.md) and musubi-tuner (docs/wan.md, docs/qwen_image.md, docs/dataset_config.md)
KOHYA_FLUX_CMDLINE = """\
accelerate launch --mixed_precision bf16 --num_cpu_threads_per_process 1 flux_train_network.py \\
  --pretrained_model_name_or_path /models/flux1-dev.safetensors --clip_l /models/clip_l.safetensors \\
  --t5xxl /models/t5xxl_fp16.safetensors --ae /models/ae.safetensors --cache_latents_to_disk \\
  --save_model_as safetensors --sdpa --persistent_data_loader_workers --max_data_loader_n_workers 2 \\
  --seed 42 --gradient_checkpointing --mixed_precision bf16 --save_precision bf16 \\
  --network_module networks.lora_flux --network_dim 4 --network_alpha 2 --network_train_unet_only \\
  --optimizer_type adamw8bit --learning_rate 1e-4 --cache_text_encoder_outputs \\
  --cache_text_encoder_outputs_to_disk --fp8_base --highvram --max_train_epochs 4 \\
  --save_every_n_epochs 1 --dataset_config dataset.toml --output_dir /out --output_name flux-lora \\
  --timestep_sampling shift --discrete_flow_shift 3.1582 --model_prediction_type raw --guidance_scale 1.0
"""

KOHYA_DATASET = """\
[general]
shuffle_caption = false
caption_extension = '.txt'
keep_tokens = 1

[[datasets]]
resolution = 512
batch_size = 1
keep_tokens = 2

  [[datasets.subsets]]
  image_dir = '{root}/data'
  class_tokens = 'sks girl'
  num_repeats = 10

  [[datasets.subsets]]
  image_dir = '{root}/reg'
  class_tokens = 'girl'
  is_reg = true
  num_repeats = 1
"""

# a --config_file TOML (its sections are read as one namespace); the rest is sd-scripts' defaults
KOHYA_CONFIG_FOLDERS = """\
[model_arguments]
pretrained_model_name_or_path = "black-forest-labs/FLUX.1-schnell"
network_module = "networks.lora_flux"

[training_arguments]
train_data_dir = "{root}/kohya"
resolution = "768,512"
train_batch_size = 2
max_train_steps = 800
learning_rate = 5e-4
lr_scheduler = "cosine_with_restarts"
lr_warmup_steps = 50
optimizer_type = "Lion"
max_grad_norm = 0
network_dim = 8
network_alpha = 8
caption_extension = ".txt"
save_every_n_steps = 200
save_last_n_epochs = 3
output_dir = "out"
"""

KOHYA_LOKR_EPOCHS = """\
pretrained_model_name_or_path = "black-forest-labs/FLUX.1-dev"
network_module = "lycoris.kohya"
network_args = ["algo=lokr", "factor=4", "conv_dim=4"]
network_dim = 10000
network_alpha = 1
train_data_dir = "{root}/concepts"
resolution = 512
train_batch_size = 2
max_train_epochs = 3
learning_rate = 1
optimizer_type = "Prodigy"
optimizer_args = ["weight_decay=0.01", "decouple=True"]
lr_scheduler = "constant"
save_every_n_epochs = 1
mixed_precision = "bf16"
"""


# docs/wan.md: Wan 2.2 T2V-A14B, both experts (--dit the low-noise one, --dit_high_noise the high-noise one)
MUSUBI_WAN_CMDLINE = """\
accelerate launch --num_cpu_threads_per_process 1 --mixed_precision bf16 src/musubi_tuner/wan_train_network.py \\
    --task t2v-A14B --dit /models/wan2.2_t2v_low_noise_14B_fp16.safetensors \\
    --dit_high_noise /models/wan2.2_t2v_high_noise_14B_fp16.safetensors --timestep_boundary 875 \\
    --offload_inactive_dit --vae /models/wan_2.1_vae.safetensors --t5 /models/models_t5_umt5-xxl-enc-bf16.pth \\
    --dataset_config ds.toml --sdpa --mixed_precision bf16 --fp8_base \\
    --optimizer_type adamw8bit --learning_rate 2e-4 --gradient_checkpointing \\
    --max_data_loader_n_workers 2 --persistent_data_loader_workers --network_module networks.lora_wan \\
    --network_dim 32 --timestep_sampling shift --discrete_flow_shift 3.0 --max_train_steps 1600 \\
    --save_every_n_steps 100 --seed 42 --output_dir out --output_name wan-lora
"""

MUSUBI_WAN_I2V_CMDLINE = """\
accelerate launch src/musubi_tuner/wan_train_network.py --task i2v-A14B \\
    --dit /models/wan2.2_i2v_low_noise_14B_fp16.safetensors --dataset_config ds.toml --network_dim 16
"""

# docs/dataset_config.md's image dataset
MUSUBI_DATASET = """\
[general]
resolution = [960, 544]
caption_extension = ".txt"
batch_size = 1
enable_bucket = true
bucket_no_upscale = false

[[datasets]]
image_directory = "{root}/data"
cache_directory = "{root}/cache"
num_repeats = 2
"""

# docs/qwen_image.md's options, as a --config_file TOML (musubi-tuner's dit/vae/text_encoder files)
MUSUBI_QWEN_CONFIG = """\
dit = "/models/qwen_image_bf16.safetensors"
vae = "/models/vae/diffusion_pytorch_model.safetensors"
text_encoder = "/models/qwen_2.5_vl_7b.safetensors"
dataset_config = "qwen-data.toml"
network_module = "networks.lora_qwen_image"
network_dim = 16
network_alpha = 16
learning_rate = 5e-5
optimizer_type = "adamw8bit"
max_train_steps = 500
save_every_n_steps = 50
gradient_checkpointing = true
blocks_to_swap = 16
timestep_sampling = "qinglong_qwen"
mixed_precision = "bf16"
seed = 1
"""

# resolution left to musubi-tuner's default (960, 544)
MUSUBI_QWEN_DATASET = """\
[general]
caption_extension = ".txt"
batch_size = 2

[[datasets]]
image_directory = "{root}/data"
num_repeats = 1
"""

# ---------------------------------------------------------------- OneTrainer (training_presets/*.json: only what
# differs from TrainConfig's defaults; concepts and samples as the UI saves them)
ONETRAINER_FLUX = """\
{{
    "base_model_name": "black-forest-labs/FLUX.1-dev",
    "batch_size": 2,
    "learning_rate": 0.0003,
    "learning_rate_scheduler": "COSINE",
    "learning_rate_warmup_steps": 20,
    "epochs": 10,
    "model_type": "FLUX_DEV_1",
    "output_model_destination": "models/lora.safetensors",
    "output_model_format": "DIFFUSERS_LORA",
    "resolution": "768",
    "lora_rank": 16,
    "lora_decompose": true,
    "optimizer": {{"optimizer": "ADAMW_8BIT", "weight_decay": 0.01, "eps": 1e-08}},
    "transformer": {{"train": true, "weight_dtype": "NFLOAT_4"}},
    "text_encoder": {{"train": false, "weight_dtype": "BFLOAT_16"}},
    "text_encoder_2": {{"train": false, "weight_dtype": "NFLOAT_4"}},
    "training_method": "LORA",
    "vae": {{"weight_dtype": "FLOAT_32"}},
    "train_dtype": "BFLOAT_16",
    "timestep_distribution": "LOGIT_NORMAL",
    "dynamic_timestep_shifting": true,
    "ema": "GPU", "ema_decay": 0.998,
    "save_every": 5, "save_every_unit": "EPOCH",
    "sample_after": 100, "sample_after_unit": "STEP",
    "concept_file_name": "concepts.json", "sample_definition_file_name": "samples.json"
}}
"""

ONETRAINER_CONCEPTS = """\
[{{"name": "dog", "path": "{root}/data", "seed": -12345, "enabled": true, "type": "STANDARD",
  "include_subdirectories": false, "balancing": 2.0, "balancing_strategy": "REPEATS",
  "text": {{"prompt_source": "sample", "prompt_path": "", "enable_tag_shuffling": false}},
  "image": {{"enable_random_flip": true}}}},
 {{"name": "off", "path": "{root}/reg", "enabled": false}}]
"""

ONETRAINER_SAMPLES = """\
[{{"enabled": true, "prompt": "a dog on a beach", "negative_prompt": "blurry", "height": 768, "width": 768,
  "seed": 7, "random_seed": false, "diffusion_steps": 20, "cfg_scale": 3.5}},
 {{"enabled": false, "prompt": "not this one"}}]
"""

ONETRAINER_CHROMA = """\
{{"__version": 11, "training_method": "LORA", "model_type": "CHROMA_1", "base_model_name": "lodestones/Chroma1-HD",
 "peft_type": "LOHA", "lora_rank": 8, "lora_alpha": 8.0, "learning_rate": 0.0001, "batch_size": 1,
 "learning_rate_warmup_steps": 0.5, "train_dtype": "BFLOAT_16",
 "epochs": 2, "resolution": "512", "optimizer": {{"optimizer": "PRODIGY"}}, "timestep_distribution": "UNIFORM",
 "ema": "OFF", "ema_decay": 0.999, "save_every": 30, "save_every_unit": "STEP", "sample_after": 0,
 "sample_after_unit": "NEVER", "transformer": {{"train": true, "gradient_checkpointing": false}},
 "concepts": [{{"path": "{root}/data", "balancing": 1.5}}]}}
"""

# a preset that says almost nothing: OneTrainer's defaults decide the run
ONETRAINER_MINIMAL = """\
{{"training_method": "LORA", "model_type": "Z_IMAGE", "base_model_name": "Tongyi-MAI/Z-Image-Turbo",
 "concepts": [{{"path": "{root}/data"}}]}}
"""


# ---------------------------------------------------------------- SimpleTuner (documentation/OPTIONS.md,
# documentation/DATALOADER.md, the quickstart config.json / multidatabackend.json)
SIMPLETUNER_FLUX = """\
{{"--model_type": "lora", "--model_family": "flux", "--model_flavour": "dev",
 "--pretrained_model_name_or_path": "black-forest-labs/FLUX.1-dev", "--lora_rank": 16, "--lora_alpha": 8,
 "--lora_type": "standard", "--learning_rate": 1e-4, "--max_train_steps": 3000, "--train_batch_size": 1,
 "--gradient_accumulation_steps": 2, "--optimizer": "adamw_bf16", "--lr_scheduler": "cosine",
 "--lr_warmup_steps": 100, "--checkpointing_steps": 250, "--checkpoints_total_limit": 5,
 "--validation_prompt": "a photo of sks dog", "--validation_steps": 250, "--validation_guidance": 3.0,
 "--validation_num_inference_steps": 20, "--validation_seed": 42, "--data_backend_config": "multidatabackend.json",
 "--output_dir": "output/models", "--seed": 7, "--mixed_precision": "bf16", "--base_model_precision": "int8-quanto",
 "--caption_dropout_probability": 0.1, "--report_to": "wandb", "--use_ema": true, "--ema_decay": 0.995,
 "--gradient_checkpointing": true, "--max_grad_norm": 1.0}}
"""

SIMPLETUNER_BACKENDS = """\
[{{"id": "dogs", "type": "local", "instance_data_dir": "{root}/data", "crop": false, "resolution": 1024,
  "resolution_type": "pixel_area", "minimum_image_size": 256, "caption_strategy": "instanceprompt",
  "instance_prompt": "sks dog", "repeats": 4, "cache_dir_vae": "cache/vae", "metadata_backend": "discovery",
  "disabled": false}},
 {{"id": "text-embeds", "dataset_type": "text_embeds", "default": true, "type": "local",
  "cache_dir": "cache/text", "disabled": false}}]
"""

SIMPLETUNER_LYCORIS = """\
{{"model_type": "lora", "model_family": "flux", "model_flavour": "dev",
 "lora_type": "lycoris", "lycoris_config": "lycoris.json", "learning_rate": 4e-4, "num_train_epochs": 5,
 "train_batch_size": 3, "optimizer": "optimi-lion", "lr_scheduler": "polynomial", "checkpointing_steps": 50,
 "data_backend_config": "backends.json", "instance_prompt": "sks dog", "resolution": 1.0, "resolution_type": "area"}}
"""

SIMPLETUNER_LYCORIS_CONFIG = """\
{{"algo": "lokr", "multiplier": 1.0, "linear_dim": 10000, "linear_alpha": 1, "factor": 16}}
"""

SIMPLETUNER_TEXTFILE_BACKENDS = """\
[{{"id": "pics", "type": "local", "instance_data_dir": "{root}/data", "caption_strategy": "textfile"}}]
"""

# no model path: the flavour names it (chroma's hd → its HUGGINGFACE_PATHS entry)
SIMPLETUNER_CHROMA_FLAVOUR = """\
{{"model_type": "lora", "model_family": "chroma", "model_flavour": "hd", "lora_rank": 32,
 "train_batch_size": 1, "gradient_accumulation_steps": 4, "max_train_steps": 100, "checkpointing_steps": 25, "data_backend_config": "backends.json"}}
"""

SIMPLETUNER_PLAIN_NO_BACKENDS = """\
{{"model_type": "lora", "model_family": "sd3", "pretrained_model_name_or_path": "stabilityai/sd3",
 "data_backend_config": "missing.json", "lora_rank": 4}}
"""

# ---------------------------------------------------------------- diffusion-pipe (examples/main_example.toml,
# examples/dataset.toml, docs/supported_models.md)
DIFFUSION_PIPE_FLUX = """\
output_dir = '/data/runs/flux'
dataset = 'dataset.toml'
epochs = 2
micro_batch_size_per_gpu = 1
pipeline_stages = 1
gradient_accumulation_steps = 4
gradient_clipping = 1.0
warmup_steps = 2
eval_every_n_epochs = 1
eval_before_first_step = true
save_every_n_epochs = 1
checkpoint_every_n_minutes = 30
activation_checkpointing = true
partition_method = 'parameters'
save_dtype = 'bfloat16'
caching_batch_size = 1
steps_per_print = 1

[model]
type = 'flux'
diffusers_path = 'black-forest-labs/FLUX.1-dev'
dtype = 'bfloat16'
transformer_dtype = 'float8'
timestep_sample_method = 'logit_normal'

[adapter]
type = 'lora'
rank = 32
dtype = 'bfloat16'

[optimizer]
type = 'adamw_optimi'
lr = 2e-5
betas = [0.9, 0.99]
weight_decay = 0.01
eps = 1e-8

[monitoring]
enable_wandb = false
wandb_api_key = ''
"""

DIFFUSION_PIPE_DATASET = """\
resolutions = [512]
enable_ar_bucket = true
min_ar = 0.5
max_ar = 2.0
num_ar_buckets = 7

[[directory]]
path = '{root}/data'
num_repeats = 5

[[directory]]
path = '{root}/reg'
num_repeats = 1
"""

# docs/supported_models.md's Chroma: FLUX.1-dev's folder with Chroma's transformer file over it; an alpha is
# refused by diffusion-pipe itself (train.py), so the import does not carry it either
DIFFUSION_PIPE_CHROMA = """\
dataset = 'chroma-data.toml'
epochs = 3
micro_batch_size_per_gpu = 2
save_every_n_steps = 3
[model]
type = 'chroma'
diffusers_path = 'black-forest-labs/FLUX.1-dev'
transformer_path = '/models/chroma-unlocked-v10.safetensors'
dtype = 'bfloat16'
flux_shift = true
[adapter]
type = 'lora'
rank = 16
alpha = 16
[optimizer]
type = 'AdamW8bitKahan'
lr = 1e-4
"""

DIFFUSION_PIPE_CHROMA_DATASET = """\
resolutions = [[512, 768]]
frame_buckets = [1]
[[directory]]
path = '{root}/data'
"""

# docs/supported_models.md's Wan2.2: the low-noise T2V expert from its ComfyUI file, min_t/max_t its side
DIFFUSION_PIPE_WAN22 = """\
dataset = 'wan-data.toml'
epochs = 1
max_steps = 4
micro_batch_size_per_gpu = 1
save_every_n_epochs = 1
blocks_to_swap = 8
activation_checkpointing = true
[model]
type = 'wan'
ckpt_path = '/models/Wan2.2-T2V-A14B'
transformer_path = '/models/wan2.2_t2v_low_noise_14B_fp16.safetensors'
llm_path = '/models/umt5_xxl_fp16.safetensors'
dtype = 'bfloat16'
transformer_dtype = 'float8'
min_t = 0
max_t = 0.875
[adapter]
type = 'lora'
rank = 32
dtype = 'bfloat16'
[optimizer]
type = 'adamw_optimi'
lr = 5e-5
"""

DIFFUSION_PIPE_WAN22_DATASET = """\
resolutions = [512]
frame_buckets = [1]
[[directory]]
path = '{root}/data'
num_repeats = 2
"""

DIFFUSION_PIPE_HUNYUAN = """\
dataset = 'dataset.toml'
epochs = 1
[model]
type = 'hunyuan-video'
ckpt_path = '/models/hunyuan'
[adapter]
type = 'lora'
rank = 8
"""

# (case id, file name, text, dataset (name, text) or None (a list: the first is --dataset, the others files the
# config names beside it; a name starting with + is only written beside it), expected lorad values (None: left to
# lorad's default), expected not-carried keys)
CASES = [
    ("ai-toolkit-flux", "flux.yaml", AI_TOOLKIT_FLUX, None,
     {"model.family": "flux", "model.path": "black-forest-labs/FLUX.1-dev", "lora.rank": 16, "lora.alpha": 16.0,
      "train.lr": 1e-4, "train.steps": 2000, "train.batch_size": 1, "data.resolution": [512, 768, 1024],
      "train.optimizer": "adamw8bit", "checkpoint.every_steps": 250, "checkpoint.keep": 4, "data.trigger": "p3r5on",
      "data.path": "{root}/data", "train.schedule": "constant", "train.ema.decay": 0.99, "model.base_precision": "fp8",
      "data.caption_dropout": 0.05, "model.dtype": "bfloat16", "train.gradient_checkpointing": True,
      "sample.prompts": ["p3r5on holding a sign that says 'hello'", "a chess game in the park, p3r5on"],
      "sample.every_steps": 250, "sample.guidance": 4.0},
     {"job", "type", "training_folder", "device", "save.dtype", "save.push_to_hub", "datasets[0].shuffle_tokens",
      "datasets[0].cache_latents_to_disk", "train.noise_scheduler", "sample.sampler",
      "sample.sample_start_step", "meta.name", "meta.version"}),
    ("ai-toolkit-qwen-lokr-dop", "lokr.yml", AI_TOOLKIT_LOKR_DOP, None,
     {"model.family": "qwen_image", "lora.type": "lokr", "lora.rank": 32, "lora.alpha": 32.0, "lora.factor": 8,
      "train.lr": 4e-4, "train.steps": 3000, "train.batch_size": 2, "data.resolution": [1024],
      "train.optimizer": "prodigy", "train.schedule": "cosine", "checkpoint.every_steps": 500, "checkpoint.keep": 2,
      "data.trigger": "ohwx", "data.path": "{root}/data", "data.repeats": 3, "data.caption_ext": "caption",
      "data.regularisation.path": "{root}/reg", "train.timestep_sampling": "shift", "model.base_precision": "fp8",
      "train.dop.preservation_class": "person", "train.dop.weight": 0.5, "name": "person-lokr",
      "sample.every_steps": None},
     {"job", "type", "training_folder", "network.conv", "train.content_or_style", "sample.sample_every"}),
    ("ai-toolkit-chroma-dora", "chroma.yaml", AI_TOOLKIT_CHROMA, None,
     {"model.family": "chroma", "lora.type": "dora", "lora.rank": 8, "train.lr": 1e-4,
      "lora.alpha": 1.0,  # ai-toolkit's linear_alpha defaults to alpha's 1.0, not lorad's 16
      "model.dtype": "float32",  # ai-toolkit's train.dtype default fp32
      "train.steps": 400, "train.batch_size": 1, "train.grad_accum": 4, "data.resolution": [768],
      "train.optimizer": "adamw", "checkpoint.every_steps": 100, "data.trigger": "in the style of xyz",
      "data.path": "{root}/data", "data.flip": True, "train.schedule": "linear", "train.timestep_sampling": "linear",
      "train.max_grad_norm": 0.5, "train.gradient_checkpointing": True,
      "sample.prompts": [{"prompt": "a house, in the style of xyz", "negative": "low quality", "seed": None,
                          "control": None}]},
     {"job", "type", "train.train_text_encoder", "sample.walk_seed"}),
    ("ai-toolkit-wan22-high", "wan.yaml", AI_TOOLKIT_WAN22, None,
     {"model.family": "wan", "model.path": "Wan-AI/Wan2.2-T2V-A14B-Diffusers", "model.expert": "high",
      "model.base_precision": "fp8", "lora.rank": 32, "lora.alpha": 32.0, "train.lr": 1e-4, "train.steps": 2000,
      "train.batch_size": 1, "data.resolution": [512], "train.optimizer": "adamw8bit", "train.weight_decay": 1e-4,
      "checkpoint.every_steps": 250, "data.trigger": "sks", "data.path": "{root}/data",
      "train.timestep_sampling": "linear"},
     {"job", "type", "device", "save.dtype", "datasets[0].num_frames", "train.switch_boundary_every",
      "train.cache_text_embeddings", "sample.num_frames", "sample.fps"}),
    ("kohya-flux-cmdline", "train.sh", KOHYA_FLUX_CMDLINE, ("dataset.toml", KOHYA_DATASET),
     {"model.family": "flux", "model.path": "black-forest-labs/FLUX.1-dev", "lora.rank": 4, "lora.alpha": 2.0,
      "train.lr": 1e-4, "train.steps": 4 * 3 * 10, "train.batch_size": 1, "data.resolution": [512],
      "train.optimizer": "adamw8bit", "checkpoint.every_steps": 30, "data.trigger": None,
      "data.path": "{root}/data", "data.repeats": 10, "data.regularisation.path": "{root}/reg",
      "data.caption_ext": "txt", "model.base_precision": "fp8", "model.dtype": "bfloat16",
      "train.timestep_sampling": "shift", "train.guidance": 1.0, "train.seed": 42, "train.schedule": "constant"},
     {"clip_l", "t5xxl", "ae", "cache_latents_to_disk", "save_model_as", "sdpa", "persistent_data_loader_workers",
      "max_data_loader_n_workers", "save_precision", "network_train_unet_only", "cache_text_encoder_outputs",
      "cache_text_encoder_outputs_to_disk", "highvram", "dataset_config", "output_dir", "output_name",
      "model_prediction_type", "general.shuffle_caption", "general.keep_tokens", "datasets[0].keep_tokens",
      "datasets[0].subsets[0].class_tokens", "datasets[0].subsets[1].class_tokens"}),
    ("kohya-config-folders", "config.toml", KOHYA_CONFIG_FOLDERS, None,
     {"model.family": "flux", "model.path": "black-forest-labs/FLUX.1-schnell", "lora.rank": 8, "lora.alpha": 8.0,
      "train.lr": 5e-4, "train.steps": 800, "train.batch_size": 2, "data.resolution": [627],
      "train.optimizer": None, "checkpoint.every_steps": 200, "checkpoint.keep": 3, "data.trigger": "sks dog",
      "data.path": "{root}/kohya/10_sks dog", "data.repeats": 10, "train.max_grad_norm": None,
      "train.warmup_steps": 50, "train.schedule": None,
      # sd-scripts' defaults: mixed_precision "no" (float32); flux_train_network's sigma sampling under
      # discrete_flow_shift 3.0 (lorad's shift) and guidance_scale 3.5
      "model.dtype": "float32", "train.timestep_sampling": "shift", "train.guidance": 3.5},
     {"optimizer_type", "lr_scheduler", "output_dir"}),
    ("kohya-lokr-epochs", "lokr.toml", KOHYA_LOKR_EPOCHS, None,
     {"model.family": "flux", "lora.type": "lokr", "lora.factor": 4, "lora.rank": None, "lora.alpha": 1.0,
      "train.lr": 1.0, "train.optimizer": "prodigy", "train.weight_decay": 0.01, "train.batch_size": 2,
      "data.resolution": [512], "data.path": "{root}/concepts", "data.repeats": 4,
      "data.caption_ext": "caption",  # sd-scripts' --caption_extension default .caption
      # (2 images × 4 + 1 image × 2) ÷ 4 repeats = 2.5 images a pass of 4 repeats: ceil(2.5 × 4 ÷ 2) = 5 a epoch
      "train.steps": 3 * 5, "checkpoint.every_steps": 5, "data.trigger": None, "train.guidance": 3.5},
     {"network_args.conv_dim", "optimizer_args.decouple", "train_data_dir/2_cat", "train_data_dir/N_name",
      "network_dim"}),
    ("musubi-wan22-both-experts", "wan.sh", MUSUBI_WAN_CMDLINE, ("ds.toml", MUSUBI_DATASET),
     {"model.family": "wan", "model.path": "Wan-AI/Wan2.2-T2V-A14B-Diffusers", "model.expert": "both",
      "model.task": "t2v", "lora.rank": 32, "train.lr": 2e-4,
      "lora.alpha": 1.0,  # sd-scripts' and musubi's default network_alpha, not lorad's 16
      "data.trigger": None, "train.steps": 1600, "train.batch_size": 1, "data.resolution": [723],
      "train.optimizer": "adamw8bit", "checkpoint.every_steps": 100, "data.path": "{root}/data", "data.repeats": 2,
      "model.base_precision": "fp8", "train.timestep_sampling": "shift"},
     {"timestep_boundary", "offload_inactive_dit", "vae", "t5", "sdpa", "max_data_loader_n_workers",
      "persistent_data_loader_workers", "output_dir", "output_name", "dataset_config", "datasets[0].cache_directory",
      "general.enable_bucket", "general.bucket_no_upscale"}),
    ("musubi-qwen-config", "qwen.toml", MUSUBI_QWEN_CONFIG, [("+qwen-data.toml", MUSUBI_QWEN_DATASET)],
     {"model.family": "qwen_image", "model.path": "Qwen/Qwen-Image", "lora.rank": 16, "train.lr": 5e-5,
      "lora.alpha": 16.0, "data.trigger": None, "train.steps": 500, "train.batch_size": 2,
      "data.resolution": [723],  # musubi-tuner's dataset default (960, 544)
      "train.optimizer": "adamw8bit", "checkpoint.every_steps": 50, "data.path": "{root}/data",
      "train.blocks_to_swap": 16, "train.gradient_checkpointing": True, "train.timestep_sampling": None},
     {"vae", "text_encoder", "dataset_config", "timestep_sampling"}),
    ("onetrainer-flux", "preset.json", ONETRAINER_FLUX, [("concepts.json", ONETRAINER_CONCEPTS),
                                                         ("samples.json", ONETRAINER_SAMPLES)],
     {"model.family": "flux", "lora.type": "dora", "lora.rank": 16, "lora.alpha": 1.0, "train.lr": 3e-4,
      "train.steps": 10 * 3 * 2 // 2, "train.batch_size": 2, "data.resolution": [768], "train.optimizer": "adamw8bit",
      "checkpoint.every_steps": 15, "data.path": "{root}/data", "data.repeats": 2, "data.flip": True,
      "model.base_precision": "nf4", "train.gradient_checkpointing": True,
      "train.schedule": "cosine", "train.ema.decay": 0.998, "model.dtype": "bfloat16",
      "train.timestep_sampling": "sigmoid", "sample.every_steps": 100,
      "sample.prompts": [{"prompt": "a dog on a beach", "negative": "", "seed": 7, "control": None}],
      "data.trigger": None},
     {"output_model_format", "output_model_destination", "concept_file_name", "sample_definition_file_name",
      "text_encoder.train", "text_encoder.weight_dtype", "text_encoder_2.train", "text_encoder_2.weight_dtype",
      "vae.weight_dtype", "dynamic_timestep_shifting", "concepts[0].name", "concepts[0].enabled", "concepts[0].seed",
      "concepts[0].include_subdirectories", "concepts[0].balancing_strategy",
      "concepts[0].text.enable_tag_shuffling", "samples[0].negative_prompt", "samples[0].height",
      "samples[0].width", "samples[0].diffusion_steps", "samples[0].cfg_scale", "samples[1]"}),
    ("onetrainer-chroma-loha", "chroma.json", ONETRAINER_CHROMA, None,
     {"model.family": "chroma", "lora.type": "loha", "lora.rank": 8, "train.lr": 1e-4, "train.steps": 2 * 3,
      "lora.alpha": 8.0, "data.trigger": None, "train.gradient_checkpointing": False,
      "train.warmup_steps": 3,  # OneTrainer's 0.5: half of the run's 6 steps
      "train.batch_size": 1, "data.resolution": [512], "train.optimizer": "prodigy", "checkpoint.every_steps": 30,
      "data.path": "{root}/data", "data.repeats": None, "train.timestep_sampling": "linear", "train.ema": None,
      "sample.every_steps": None, "train.schedule": "constant"},
     {"__version", "concepts[0].balancing", "ema_decay", "sample_after"}),
    ("onetrainer-minimal-preset", "z.json", ONETRAINER_MINIMAL, None,  # only what differs from its defaults
     {"model.family": "z_image", "lora.rank": None, "lora.alpha": 1.0, "train.optimizer": "adamw",
      "train.schedule": "constant", "train.lr": 3e-6, "train.warmup_steps": 200, "train.weight_decay": 0.01,
      "train.steps": 100 * 3, "model.dtype": "float16", "train.timestep_sampling": "linear",
      "train.gradient_checkpointing": True, "data.path": "{root}/data", "data.trigger": None,
      # not in the preset, and OneTrainer's default is lorad's: nothing written
      "train.batch_size": None, "data.resolution": None, "checkpoint.every_steps": None},
     set()),
    ("simpletuner-flux", "config.json", SIMPLETUNER_FLUX, ("multidatabackend.json", SIMPLETUNER_BACKENDS),
     {"model.family": "flux", "lora.rank": 16, "lora.alpha": 8.0, "train.lr": 1e-4, "train.steps": 3000,
      "train.batch_size": 1, "train.grad_accum": 2, "data.resolution": [1024], "train.optimizer": "adamw",
      "checkpoint.every_steps": 250, "checkpoint.keep": 5, "data.trigger": "sks dog", "data.path": "{root}/data",
      "data.repeats": 5, "model.base_precision": "int8", "train.ema.decay": 0.995,
      "sample.prompts": ["a photo of sks dog"], "sample.every_steps": 250, "data.caption_dropout": 0.1,
      "train.seed": 7, "train.max_grad_norm": 1.0},
     {"data_backend_config", "output_dir", "report_to", "backends[text-embeds]", "backends[0].id",
      "backends[0].type", "backends[0].crop", "backends[0].minimum_image_size", "backends[0].cache_dir_vae",
      "backends[0].metadata_backend", "backends[0].disabled"}),
    ("simpletuner-plain-lycoris", "st.json", SIMPLETUNER_LYCORIS,
     [("backends.json", SIMPLETUNER_TEXTFILE_BACKENDS), ("lycoris.json", SIMPLETUNER_LYCORIS_CONFIG)],
     {"model.family": "flux", "lora.type": "lokr", "lora.factor": 16, "train.lr": 4e-4, "train.steps": 5 * 1,
      "model.path": "black-forest-labs/FLUX.1-dev",  # from model_flavour: the config names no path
      "lora.rank": None, "lora.alpha": None,  # a LyCORIS config's own linear_dim/alpha are not lorad's rank
      "train.batch_size": 3, "data.resolution": [1000], "train.optimizer": None, "checkpoint.every_steps": 50,
      "data.path": "{root}/data", "data.trigger": None, "train.schedule": None,
      # SimpleTuner's defaults
      "train.max_grad_norm": 2.0, "data.caption_dropout": 0.1, "train.gradient_checkpointing": True},
     {"lora_type", "optimizer", "lr_scheduler", "instance_prompt", "data_backend_config", "backends[0].id",
      "backends[0].type", "lycoris_config.multiplier", "lycoris_config.linear_dim", "lycoris_config.linear_alpha"}),
    ("simpletuner-chroma-flavour", "c.json", SIMPLETUNER_CHROMA_FLAVOUR, [("+backends.json",
                                                                         SIMPLETUNER_TEXTFILE_BACKENDS)],
     {"model.family": "chroma", "model.path": "lodestones/Chroma1-HD", "lora.rank": 32,
      "lora.alpha": 32.0,  # SimpleTuner's alpha is the rank when unset
      "train.lr": 4e-7, "train.optimizer": "adamw", "train.schedule": "constant", "train.steps": 100,
      "train.batch_size": 1, "train.grad_accum": 4, "data.resolution": [1024], "checkpoint.every_steps": 25,
      "data.path": "{root}/data", "data.trigger": None},
     {"data_backend_config", "backends[0].id", "backends[0].type"}),
    ("diffusion-pipe-flux", "main.toml", DIFFUSION_PIPE_FLUX, ("dataset.toml", DIFFUSION_PIPE_DATASET),
     {"model.family": "flux", "model.path": "black-forest-labs/FLUX.1-dev", "lora.rank": 32, "train.lr": 2e-5,
      "lora.alpha": 32.0,  # diffusion-pipe trains at alpha = rank
      "train.steps": 2 * 4, "train.batch_size": 1, "train.grad_accum": 4, "data.resolution": [512],
      "train.optimizer": "adamw", "checkpoint.every_steps": 4, "checkpoint.every_seconds": 1800.0,
      "data.path": "{root}/data", "data.repeats": 5, "lora.dtype": "bfloat16", "model.base_precision": "fp8",
      "train.timestep_sampling": "sigmoid", "train.optimizer_args.betas": [0.9, 0.99], "train.weight_decay": 0.01,
      "data.trigger": None},
     {"output_dir", "dataset", "pipeline_stages", "partition_method", "save_dtype", "caching_batch_size",
      "steps_per_print", "eval_every_n_epochs", "eval_before_first_step", "monitoring.enable_wandb",
      "monitoring.wandb_api_key", "dataset.enable_ar_bucket", "dataset.min_ar", "dataset.max_ar",
      "dataset.num_ar_buckets", "dataset.directory[1]"}),
    ("diffusion-pipe-chroma", "chroma.toml", DIFFUSION_PIPE_CHROMA, [("+chroma-data.toml",
                                                                      DIFFUSION_PIPE_CHROMA_DATASET)],
     {"model.family": "chroma", "model.path": "lodestones/Chroma", "lora.rank": 16, "lora.alpha": 16.0,
      "data.trigger": None, "train.lr": 1e-4, "train.steps": 3 * 2, "train.batch_size": 2,
      "data.resolution": [627], "train.optimizer": None, "checkpoint.every_steps": 3, "data.path": "{root}/data",
      "train.timestep_sampling": "shift"},
     {"dataset", "model.diffusers_path", "adapter.alpha", "optimizer.type", "dataset.frame_buckets"}),
    ("diffusion-pipe-wan22-low", "wan.toml", DIFFUSION_PIPE_WAN22, [("+wan-data.toml", DIFFUSION_PIPE_WAN22_DATASET)],
     {"model.family": "wan", "model.path": "Wan-AI/Wan2.2-T2V-A14B-Diffusers", "model.expert": "low",
      "lora.rank": 32, "lora.alpha": 32.0, "train.lr": 5e-5,
      "train.steps": 4,  # one epoch is 3 × 2 steps; max_steps stops it at 4
      "train.batch_size": 1,
      "data.resolution": [512], "train.optimizer": "adamw", "checkpoint.every_steps": 6, "data.path": "{root}/data",
      "data.trigger": None, "train.blocks_to_swap": 8, "model.base_precision": "fp8"},
     {"dataset", "model.ckpt_path", "model.llm_path", "dataset.frame_buckets"}),
]

# (case id, file name, text, dataset, what the one refusal line must name)
REFUSED = [
    ("musubi-wan22-i2v", "i2v.sh", MUSUBI_WAN_I2V_CMDLINE, ("ds.toml", MUSUBI_DATASET),
     r"task: i2v-A14B: Wan 2\.2 I2V-A14B .* is not among lorad's Wan models"),
    ("simpletuner-sd3", "st.json", SIMPLETUNER_PLAIN_NO_BACKENDS, None,
     r"data_backend_config: missing.json not found.*model_family: unsupported model family: 'sd3'"),
    ("diffusion-pipe-hunyuan-1.0", "hv.toml", DIFFUSION_PIPE_HUNYUAN, None,
     r"model\.type: unsupported model family: 'hunyuan-video' \(HunyuanVideo 1\.0\)"),
    ("kohya-dataset-alone", "dataset.toml", KOHYA_DATASET, None, r"a dataset config only, naming no model"),
    *SDXL_REFUSED,
]

# ai-toolkit's Z-Image Turbo recipe: its training adapter (model.assistant_lora_path) becomes model.assistant_lora.
AI_TOOLKIT_ZIMAGE_TURBO = """\
job: extension
config:
  name: turbo
  process:
    - type: sd_trainer
      trigger_word: sks
      network: {type: lora, linear: 32, linear_alpha: 32}
      save: {save_every: 250}
      datasets:
        - folder_path: {root}/data
          resolution: [1024]
      train: {batch_size: 1, steps: 3000, optimizer: adamw8bit, lr: 1e-4}
      model:
        arch: zimage
        name_or_path: Tongyi-MAI/Z-Image-Turbo
        assistant_lora_path: ostris/zimage_turbo_training_adapter
"""
CASES.append(
    ("ai-toolkit-zimage-turbo-assistant", "turbo.yaml", AI_TOOLKIT_ZIMAGE_TURBO, None,
     {"model.family": "z_image", "model.path": "Tongyi-MAI/Z-Image-Turbo",
      "model.assistant_lora": "ostris/zimage_turbo_training_adapter", "lora.rank": 32, "lora.alpha": 32.0,
      "train.lr": 1e-4, "train.steps": 3000, "train.batch_size": 1, "data.resolution": [1024],
      "train.optimizer": "adamw8bit", "checkpoint.every_steps": 250, "data.trigger": "sks", "data.path": "{root}/data"},
     {"job", "type"}))
CASES += SDXL_CASES
