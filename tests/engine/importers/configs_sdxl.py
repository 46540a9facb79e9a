"""The SDXL configs of the other trainers (model.family: sdxl, docs/families/sdxl.md), in the shape of each tool's
own SDXL examples (read, not copied), and what each imports to; configs.py appends them to its CASES and REFUSED.
The prediction type: a v-prediction switch → model.prediction: v (zero terminal SNR carried in it), kohya's
epsilon default → epsilon, and unset where the source leaves it to the base's scheduler config."""

from __future__ import annotations

# ai-toolkit (config/examples/train_lora_sdxl*.yaml's shape): arch sdxl, a v-prediction fine-tune
AI_TOOLKIT_SDXL = """\
job: extension
config:
  name: noob-vpred
  process:
    - type: sd_trainer
      training_folder: output
      trigger_word: ohwx
      network: {type: lora, linear: 16, linear_alpha: 8}
      save: {save_every: 100, max_step_saves_to_keep: 3}
      datasets: [{folder_path: "{root}/data", caption_ext: txt, resolution: [1024]}]
      train: {batch_size: 2, steps: 1000, optimizer: adamw8bit, lr: 1e-4, dtype: bf16, noise_scheduler: ddpm,
              train_text_encoder: true, train_unet: true, text_encoder_lr: 5e-5}
      model: {name_or_path: Laxhar/noobai-XL-Vpred-1.0, arch: sdxl, is_v_pred: true}
"""

# kohya sd-scripts (docs/train_network_README and sdxl_train_network.py's arguments), a v-prediction run
KOHYA_SDXL_CMDLINE = """\
accelerate launch --mixed_precision bf16 sdxl_train_network.py \\
  --pretrained_model_name_or_path stabilityai/stable-diffusion-xl-base-1.0 --network_module networks.lora \\
  --network_dim 8 --network_alpha 4 --train_data_dir {root}/kohya --resolution 1024,1024 --train_batch_size 1 \\
  --max_train_steps 10 --learning_rate 1e-4 --unet_lr 2e-4 --optimizer_type AdamW8bit --save_every_n_steps 5 \\
  --v_parameterization --zero_terminal_snr --no_half_vae --mixed_precision bf16 --output_dir out
"""

# a config TOML names no script: networks.lora is SD 1.5's and SDXL's module, the model name says which
KOHYA_SDXL_TOML = """\
[model_arguments]
pretrained_model_name_or_path = "stabilityai/stable-diffusion-xl-base-1.0"
network_module = "networks.lora"

[training_arguments]
train_data_dir = "{root}/kohya"
resolution = "1024"
max_train_steps = 300
learning_rate = 1e-4
network_dim = 32
network_alpha = 16
zero_terminal_snr = true
network_train_unet_only = true
text_encoder_lr = 5e-5
"""

# a FLUX.1 fine-tune's single file (no known name): refused as lorad's validator refuses it (an SDXL one imports:
# the SDXL trainer converts it, tests/engine/importers/test_sdxl.py)
KOHYA_FLUX_SINGLE_FILE = """\
accelerate launch flux_train_network.py --pretrained_model_name_or_path my-flux-finetune.safetensors \\
  --network_dim 8 --train_data_dir {root}/kohya --max_train_steps 10
"""

# OneTrainer (training_presets/#sdxl 1.0 LoRA.json's shape)
ONETRAINER_SDXL = """\
{{"__version": 11, "training_method": "LORA", "model_type": "STABLE_DIFFUSION_XL_10_BASE",
 "base_model_name": "stabilityai/stable-diffusion-xl-base-1.0", "concepts": [{{"path": "{root}/data"}}],
 "force_v_prediction": true, "force_epsilon_prediction": false,
 "rescale_noise_scheduler_to_zero_terminal_snr": true, "learning_rate": 1e-4, "lora_rank": 16, "lora_alpha": 16,
 "batch_size": 1, "resolution": "1024", "epochs": 2, "save_every": 2, "save_every_unit": "EPOCH"}}
"""

# OneTrainer (training_presets/SDXL/#sdxl 1.0 LoRA.json's part sections): the first encoder alone, at its own rate,
# for its first 2 epochs of 4
ONETRAINER_SDXL_TE = """\
{{"__version": 11, "training_method": "LORA", "model_type": "STABLE_DIFFUSION_XL_10_BASE",
 "base_model_name": "stabilityai/stable-diffusion-xl-base-1.0", "concepts": [{{"path": "{root}/data"}}],
 "learning_rate": 3e-4, "lora_rank": 16, "lora_alpha": 16, "batch_size": 1, "resolution": "1024", "epochs": 4,
 "unet": {{"train": true, "weight_dtype": "FLOAT_16"}},
 "text_encoder": {{"train": true, "learning_rate": 5e-5, "stop_training_after": 2, "stop_training_after_unit": "EPOCH"}},
 "text_encoder_2": {{"train": false}}}}
"""

# SimpleTuner (documentation/quickstart/SDXL.md's config.json shape): the flavour names the model
SIMPLETUNER_SDXL = """\
{{"--model_type": "lora", "--model_family": "sdxl", "--model_flavour": "base-1.0", "--lora_rank": 16,
 "--prediction_type": "v_prediction", "--rescale_betas_zero_snr": true, "--learning_rate": 1e-4,
 "--max_train_steps": 500, "--train_batch_size": 1, "--resolution": 1024, "--checkpointing_steps": 100,
 "--optimizer": "adamw_bf16", "--lr_scheduler": "constant", "--data_backend_config": "backends.json",
 "--train_text_encoder": true, "--text_encoder_lr": 5e-5}}
"""
SIMPLETUNER_SDXL_BACKENDS = """\
[{{"id": "images", "type": "local", "instance_data_dir": "{root}/data", "caption_strategy": "textfile"}}]
"""

# Models lorad does not train, one for each tool whose SDXL case imports now
AI_TOOLKIT_SD15 = """\
job: extension
config:
  name: sd15
  process:
    - type: sd_trainer
      network: {type: lora, linear: 8, linear_alpha: 8}
      datasets: [{folder_path: "{root}/data"}]
      train: {steps: 10}
      model: {name_or_path: stable-diffusion-v1-5/stable-diffusion-v1-5, arch: sd1}
"""
KOHYA_SD3_CMDLINE = """\
accelerate launch sd3_train_network.py --pretrained_model_name_or_path /models/sd3.5_large.safetensors \\
  --network_dim 8 --train_data_dir {root}/kohya --max_train_steps 10
"""
KOHYA_SD15_TOML = """\
pretrained_model_name_or_path = "stable-diffusion-v1-5/stable-diffusion-v1-5"
network_module = "networks.lora"
train_data_dir = "{root}/kohya"
max_train_steps = 10
"""
ONETRAINER_SD3 = """\
{{"__version": 11, "training_method": "LORA", "model_type": "STABLE_DIFFUSION_3",
 "base_model_name": "stabilityai/stable-diffusion-3-medium-diffusers", "concepts": [{{"path": "{root}/data"}}]}}
"""

# (case id, file name, text, dataset, the lorad values it must import to, the keys not carried over), as CASES
SDXL_CASES = [
    ("ai-toolkit-sdxl-vpred", "noob.yaml", AI_TOOLKIT_SDXL, None,
     {"model.family": "sdxl", "model.prediction": "v", "model.path": "Laxhar/noobai-XL-Vpred-1.0", "lora.rank": 16,
      "lora.alpha": 8.0, "train.lr": 1e-4, "train.steps": 1000, "train.batch_size": 2, "data.resolution": [1024],
      "train.optimizer": "adamw8bit", "checkpoint.every_steps": 100, "checkpoint.keep": 3, "data.trigger": "ohwx",
      "data.path": "{root}/data", "model.dtype": "bfloat16",
      # its LoRA network trains the encoders at train.lr: its text_encoder_lr is its full fine-tune's
      "lora.text_encoder": True, "lora.text_encoder_lr": None},
     {"job", "type", "training_folder", "train.noise_scheduler", "train.text_encoder_lr"}),
    ("kohya-sdxl-vpred-cmdline", "sdxl.sh", KOHYA_SDXL_CMDLINE, None,
     {"model.family": "sdxl", "model.prediction": "v", "model.path": "stabilityai/stable-diffusion-xl-base-1.0",
      "lora.rank": 8, "lora.alpha": 4.0, "train.steps": 10, "train.batch_size": 1,
      # sd-scripts trains both encoders unless --network_train_unet_only: the UNet at unet_lr, the encoders at
      # learning_rate (no text_encoder_lr)
      "train.lr": 2e-4, "lora.text_encoder": True, "lora.text_encoder_lr": 1e-4,
      "data.resolution": [1024], "train.optimizer": "adamw8bit", "checkpoint.every_steps": 5,
      "data.trigger": "sks dog", "data.path": "{root}/kohya/10_sks dog", "data.repeats": 10,
      # sdxl_train_network draws timesteps uniformly: lorad's linear, not the flow families' shift
      "train.timestep_sampling": "linear", "model.dtype": "bfloat16"},
     {"no_half_vae", "output_dir"}),
    ("kohya-sdxl-config", "sdxl.toml", KOHYA_SDXL_TOML, None,
     {"model.family": "sdxl",
      "model.prediction": "epsilon",  # sd-scripts trains epsilon unless --v_parameterization
      "lora.rank": 32, "lora.alpha": 16.0, "train.lr": 1e-4, "train.steps": 300, "train.batch_size": None,
      "data.resolution": [1024], "train.optimizer": "adamw", "checkpoint.every_steps": None,
      "data.trigger": "sks dog", "data.path": "{root}/kohya/10_sks dog", "train.timestep_sampling": "linear",
      "lora.text_encoder": False, "lora.text_encoder_lr": None},
     {"zero_terminal_snr", "text_encoder_lr"}),  # the encoders do not train: their rate does not apply  # zero terminal SNR with epsilon: lorad's epsilon keeps the base's betas
    ("onetrainer-sdxl-vpred", "sdxl.json", ONETRAINER_SDXL, None,
     {"model.family": "sdxl", "model.prediction": "v", "model.path": "stabilityai/stable-diffusion-xl-base-1.0",
      "lora.rank": 16, "lora.alpha": 16.0, "train.lr": 1e-4, "train.steps": 2 * 3, "train.batch_size": 1,
      "data.resolution": [1024], "train.optimizer": "adamw", "checkpoint.every_steps": 2 * 3, "data.trigger": None,
      "data.path": "{root}/data", "train.timestep_sampling": "linear", "model.dtype": "float16",
      "lora.text_encoder": True, "lora.text_encoder_lr": None},  # OneTrainer's default: both encoders train
     {"__version"}),
    ("onetrainer-sdxl-one-encoder", "sdxl.json", ONETRAINER_SDXL_TE, None,
     {"model.family": "sdxl", "lora.rank": 16, "lora.alpha": 16.0, "train.lr": 3e-4, "train.steps": 4 * 3,
      "train.batch_size": 1, "data.resolution": [1024], "train.optimizer": "adamw", "checkpoint.every_steps": None,
      "data.trigger": None, "data.path": "{root}/data",
      "lora.text_encoder": True, "lora.text_encoder_lr": 5e-5},
     # lorad trains both encoders or neither; the first's 2 epochs of 4 are not a stop lorad has
     {"__version", "text_encoder_2.train", "text_encoder.stop_training_after",
      "text_encoder.stop_training_after_unit", "unet.weight_dtype"}),
    ("simpletuner-sdxl-vpred", "sdxl.json", SIMPLETUNER_SDXL, [("+backends.json", SIMPLETUNER_SDXL_BACKENDS)],
     {"model.family": "sdxl", "model.prediction": "v",
      "model.path": "stabilityai/stable-diffusion-xl-base-1.0",  # the flavour base-1.0
      "lora.rank": 16, "lora.alpha": 16.0, "train.lr": 1e-4, "train.steps": 500, "train.batch_size": 1,
      "data.resolution": [1024], "train.optimizer": "adamw", "checkpoint.every_steps": 100, "data.trigger": None,
      "data.path": "{root}/data", "lora.text_encoder": True, "lora.text_encoder_lr": 5e-5},
     {"data_backend_config", "backends[0].id", "backends[0].type"}),
]

# What lorad cannot train: the text encoders alone (it always trains the UNet), in each tool's words
KOHYA_SDXL_TE_ONLY = KOHYA_SDXL_CMDLINE.replace("--output_dir out", "--output_dir out --network_train_text_encoder_only")
AI_TOOLKIT_SDXL_TE_ONLY = AI_TOOLKIT_SDXL.replace("train_unet: true", "train_unet: false")
ONETRAINER_SDXL_TE_ONLY = ONETRAINER_SDXL_TE.replace('"train": true, "weight_dtype"', '"train": false, "weight_dtype"')

# (case id, file name, text, dataset, what the one refusal line must name), as REFUSED
SDXL_REFUSED = [
    ("kohya-sdxl-text-encoder-only", "sdxl.sh", KOHYA_SDXL_TE_ONLY, None,
     r"^sdxl\.sh: network_train_text_encoder_only: lorad always trains the UNet's \(or transformer's\) LoRA, never "
     r"the text encoders alone; leave it out to train both$"),
    ("ai-toolkit-sdxl-no-unet", "noob.yaml", AI_TOOLKIT_SDXL_TE_ONLY, None,
     r"^noob\.yaml: train\.train_unet: false: the UNet does not train, and lorad always trains"),
    ("onetrainer-sdxl-no-unet", "sdxl.json", ONETRAINER_SDXL_TE_ONLY, None,
     r"^sdxl\.json: unet\.train: false: the UNet does not train, and lorad always trains"),
    ("ai-toolkit-sd15", "sd15.yaml", AI_TOOLKIT_SD15, None,
     r"model\.arch: unsupported model family: 'sd1' \(Stable Diffusion 1\.5\)"),
    ("kohya-sd3-script", "sd3.sh", KOHYA_SD3_CMDLINE, None,
     r"sd3_train_network\.py: unsupported model family: .*\(Stable Diffusion 3\)"),
    ("kohya-sd15-module", "sd15.toml", KOHYA_SD15_TOML, None,
     r"network_module: unsupported model family: 'stable-diffusion-v1-5/.*' \(Stable Diffusion 1\.5\)"),
    ("onetrainer-sd3", "sd3.json", ONETRAINER_SD3, None,
     r"model_type: unsupported model family: 'STABLE_DIFFUSION_3' \(Stable Diffusion 3\)"),
    ("kohya-flux-single-file", "flux.sh", KOHYA_FLUX_SINGLE_FILE, None,
     r"^flux\.sh: pretrained_model_name_or_path: model\.path: /\S+/my-flux-finetune\.safetensors is a single-file "
     r"checkpoint; "
     r"lorad trains on diffusers directories: convert it once .* and give DIR$"),
]
