"""A zoo of LightningModules written the way their libraries' users write them (issue 13, item 6).

Each module is idiomatic code for its library -- Hugging Face transformers (causal LM with ``labels``,
sequence classification with a padding collator, encoder-decoder), timm (``create_model``, its optimizer
factory, ``Mixup``), torchvision detection and segmentation, diffusers (UNet, noise scheduler, EMA), peft
LoRA, torchmetrics in ``training_step``, a manual-optimization GAN, a packed LSTM, reentrant and
non-reentrant activation checkpointing, a streaming dataset, Lightning's EMA callback -- and nothing in
it is adapted to the estimator. Sizes are tiny so that a fit of a few steps takes about a second on a CPU.

Every case builds its module and its training data in memory (no downloads: models from configs,
``weights=None``). The training dataset is wrapped in :class:`Counting` / :class:`CountingStream`, which
count the samples read and the iterators started, so a test can tell whether a callback drew batches of
its own.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence, pad_sequence
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, IterableDataset

__all__ = ["CASES", "Built", "Counting", "CountingStream", "ZooCase"]


# --- counting what training reads ---------------------------------------------------------------------
class Counting(Dataset[Any]):
    """A map-style dataset, counting the samples read (``reads``)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.reads = 0
        self.iters = 0  # a map-style dataset is never iterated by a DataLoader; kept for one interface

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        self.reads += 1
        return self.dataset[index]


class CountingStream(IterableDataset[Any]):
    """An iterable dataset, counting the iterators started (``iters``) and the samples yielded (``reads``)."""

    def __init__(self, stream: IterableDataset[Any]) -> None:
        self.stream = stream
        self.reads = 0
        self.iters = 0

    def __iter__(self) -> Iterator[Any]:
        self.iters += 1
        for item in self.stream:
            self.reads += 1
            yield item


@dataclass
class Built:
    """A case, built: the module, its counted training dataset, callbacks the user would add."""

    module: pl.LightningModule
    data: Counting | CountingStream
    datamodule: pl.LightningDataModule | None = None
    callbacks: list[pl.Callback] = field(default_factory=list)


@dataclass(frozen=True)
class ZooCase:
    name: str
    build: Callable[[], Built]
    max_steps: int = 2
    """``Trainer(max_steps=...)``: optimizer steps, so a two-optimizer manual step counts two."""
    what: str = ""
    known_limit: str | None = None
    """Why the estimate is known to miss this case's peak (README "Known limits"): the test then expects
    the accuracy check, and only it, to fail -- and fails when it passes, so the note cannot go stale."""

    def __str__(self) -> str:
        return self.name


# --- Hugging Face transformers ----------------------------------------------------------------------------
class LMChunks(Dataset[dict[str, Tensor]]):
    """Fixed-length chunks of a token stream, as ``group_texts`` in the HF causal-LM examples makes them."""

    def __init__(self, n: int = 32, seq_len: int = 128, vocab: int = 512) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


class CausalLM(pl.LightningModule):
    """A Llama-style decoder (grouped-query attention, SDPA) trained on ``labels``, AdamW + warmup."""

    def __init__(
        self, dataset: Dataset[Any], activation_checkpointing: bool = False, lr: float = 3e-4
    ) -> None:
        from transformers import AutoModelForCausalLM, LlamaConfig

        super().__init__()
        self.save_hyperparameters(ignore=["dataset"])
        config = LlamaConfig(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=172,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        )
        self.model = AutoModelForCausalLM.from_config(config)
        if activation_checkpointing:
            self.model.activation_checkpointing_enable()
        self.dataset = dataset

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        outputs = self.model(**batch)
        self.log("train_loss", outputs.loss, prog_bar=True)
        return outputs.loss  # type: ignore[no-any-return]

    def configure_optimizers(self) -> Any:
        from transformers import get_linear_schedule_with_warmup

        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=10, num_training_steps=100)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.dataset, batch_size=4, shuffle=True)


def _word_level_tokenizer(words: int = 500) -> Any:
    """A fast word-level tokenizer, built in memory (what ``from_pretrained`` would load)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, **{f"w{i}": i + 4 for i in range(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]"
    )


class TokenizedReviews(Dataset[dict[str, Any]]):
    """A tokenized text-classification dataset (``dataset.map(tokenize)``): lists of ids, unpadded.

    Not shuffled in training; the second batch of eight holds the longer texts, as a length-sorted or
    simply unlucky epoch does.
    """

    def __init__(self, tokenizer: Any, n: int = 32, batch_size: int = 8) -> None:
        rng = random.Random(2)
        self.rows: list[dict[str, Any]] = []
        for i in range(n):
            length = rng.randint(6, 22) if i < batch_size else rng.randint(30, 60)
            text = " ".join(f"w{rng.randrange(500)}" for _ in range(length))
            enc = tokenizer(text, truncation=True, max_length=128)
            self.rows.append({"input_ids": enc["input_ids"], "label": rng.randrange(3)})

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[i]


class SequenceClassifier(pl.LightningModule):
    """BERT-style sequence classification on dict batches padded per batch by ``DataCollatorWithPadding``."""

    def __init__(self, dataset: Dataset[Any], tokenizer: Any, lr: float = 5e-5) -> None:
        from transformers import AutoModelForSequenceClassification, BertConfig

        super().__init__()
        self.save_hyperparameters(ignore=["dataset", "tokenizer"])
        config = BertConfig(
            vocab_size=tokenizer.vocab_size,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            num_labels=3,
        )
        self.model = AutoModelForSequenceClassification.from_config(config)
        self.dataset = dataset
        self.tokenizer = tokenizer

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        outputs = self.model(**batch)
        self.log("train_loss", outputs.loss, batch_size=batch["labels"].shape[0])
        return outputs.loss  # type: ignore[no-any-return]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self) -> DataLoader[Any]:
        from transformers import DataCollatorWithPadding

        collator = DataCollatorWithPadding(self.tokenizer, return_tensors="pt")
        return DataLoader(self.dataset, batch_size=8, shuffle=False, collate_fn=collator)


class Translations(Dataset[dict[str, Tensor]]):
    """Source/target pairs, tokenized and padded to fixed lengths, pad positions of the labels -100."""

    def __init__(self, n: int = 16, src_len: int = 48, tgt_len: int = 24, vocab: int = 256) -> None:
        g = torch.Generator().manual_seed(3)
        self.src = torch.randint(2, vocab, (n, src_len), generator=g)
        self.src_len = torch.randint(src_len // 2, src_len + 1, (n,), generator=g)
        self.tgt = torch.randint(2, vocab, (n, tgt_len), generator=g)
        self.tgt_len = torch.randint(tgt_len // 2, tgt_len + 1, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.src)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        mask = torch.arange(self.src.shape[1]) < self.src_len[i]
        input_ids = self.src[i].masked_fill(~mask, 0)
        labels = self.tgt[i].masked_fill(torch.arange(self.tgt.shape[1]) >= self.tgt_len[i], -100)
        return {"input_ids": input_ids, "attention_mask": mask.long(), "labels": labels}


class Seq2Seq(pl.LightningModule):
    """A T5 encoder-decoder trained with ``labels`` (the model shifts them into decoder inputs)."""

    def __init__(self, dataset: Dataset[Any], lr: float = 1e-3) -> None:
        from transformers import T5Config, T5ForConditionalGeneration

        super().__init__()
        self.save_hyperparameters(ignore=["dataset"])
        config = T5Config(
            vocab_size=256,
            d_model=64,
            d_kv=16,
            d_ff=128,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
            pad_token_id=0,
        )
        self.model = T5ForConditionalGeneration(config)
        self.dataset = dataset

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss  # type: ignore[no-any-return]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.dataset, batch_size=4, shuffle=True)


class LoraCausalLM(pl.LightningModule):
    """peft LoRA on a GPT-2 (its ``Conv1D`` attention), only the adapters trained."""

    def __init__(self, dataset: Dataset[Any], lr: float = 1e-3) -> None:
        from peft import LoraConfig, TaskType, get_peft_model
        from transformers import GPT2Config, GPT2LMHeadModel

        super().__init__()
        self.save_hyperparameters(ignore=["dataset"])
        base = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=256, n_embd=64, n_layer=2, n_head=4))
        lora = LoraConfig(
            task_type=TaskType.CAUSAL_LM,
            r=8,
            lora_alpha=16,
            lora_dropout=0.05,
            target_modules=["c_attn"],
            fan_in_fan_out=True,
        )
        self.model = get_peft_model(base, lora)
        self.dataset = dataset

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss  # type: ignore[no-any-return]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        return torch.optim.AdamW(trainable, lr=self.hparams.lr)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.dataset, batch_size=4, shuffle=True)


# --- timm -------------------------------------------------------------------------------------------------
class Images(Dataset[tuple[Tensor, Tensor]]):
    def __init__(self, n: int = 32, shape: tuple[int, ...] = (3, 32, 32), classes: int = 10) -> None:
        g = torch.Generator().manual_seed(4)
        self.x = torch.randn(n, *shape, generator=g)
        self.y = torch.randint(0, classes, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.x[i], self.y[i]


class TimmClassifier(pl.LightningModule):
    """A tiny ViT from ``timm.create_model``, ``create_optimizer_v2``, ``Mixup``/CutMix in the step."""

    def __init__(self, dataset: Dataset[Any], lr: float = 1e-3) -> None:
        import timm
        from timm.data import Mixup
        from timm.loss import SoftTargetCrossEntropy

        super().__init__()
        self.save_hyperparameters(ignore=["dataset"])
        self.model = timm.create_model(
            "vit_tiny_patch16_224",
            pretrained=False,
            num_classes=10,
            img_size=32,
            patch_size=4,
            embed_dim=64,
            depth=2,
            num_heads=2,
        )
        self.mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=10)
        self.criterion = SoftTargetCrossEntropy()
        self.dataset = dataset

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, targets = self.mixup(*batch)
        loss = self.criterion(self.model(images), targets)
        self.log("train_loss", loss)
        return loss  # type: ignore[no-any-return]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        from timm.optim import create_optimizer_v2

        return create_optimizer_v2(self.model, opt="adamw", lr=self.hparams.lr, weight_decay=0.05)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.dataset, batch_size=8, shuffle=True, drop_last=True)


# --- torchvision ------------------------------------------------------------------------------------------
class Detections(Dataset[tuple[Tensor, dict[str, Tensor]]]):
    """Images with a varying number of boxes each (the COCO-style target dicts)."""

    def __init__(self, n: int = 8, size: int = 192, classes: int = 3) -> None:
        g = torch.Generator().manual_seed(5)
        self.images = torch.rand(n, 3, size, size, generator=g)
        self.targets: list[dict[str, Tensor]] = []
        for _ in range(n):
            k = int(torch.randint(1, 4, (), generator=g))
            xy = torch.rand(k, 2, generator=g) * size * 0.6
            wh = 16 + torch.rand(k, 2, generator=g) * size * 0.3
            boxes = torch.cat([xy, (xy + wh).clamp(max=size)], dim=1)
            self.targets.append({"boxes": boxes, "labels": torch.randint(1, classes, (k,), generator=g)})

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[Tensor, dict[str, Tensor]]:
        return self.images[i], self.targets[i]


def detection_collate(batch: list[Any]) -> tuple[Any, ...]:
    """torchvision's reference ``utils.collate_fn``."""
    return tuple(zip(*batch, strict=True))


class Detector(pl.LightningModule):
    """torchvision Faster R-CNN (MobileNetV3-FPN), train mode with targets, the loss dict summed."""

    def __init__(self, dataset: Dataset[Any], lr: float = 0.01) -> None:
        from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_320_fpn

        super().__init__()
        self.save_hyperparameters(ignore=["dataset"])
        # 128 sampled RoIs per image, as the detectron2 tutorial sets for a small dataset (default 512)
        self.model = fasterrcnn_mobilenet_v3_large_320_fpn(
            weights=None,
            weights_backbone=None,
            num_classes=3,
            min_size=192,
            max_size=192,
            box_batch_size_per_image=128,
        )
        self.dataset = dataset

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        images, targets = batch
        loss_dict = self.model(list(images), list(targets))
        loss = sum(loss_dict.values())
        self.log_dict(loss_dict, batch_size=len(images))
        return loss  # type: ignore[no-any-return]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.model.parameters() if p.requires_grad]
        return torch.optim.SGD(params, lr=self.hparams.lr, momentum=0.9, weight_decay=1e-4)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.dataset, batch_size=2, shuffle=True, collate_fn=detection_collate)


class SegmentationMasks(Dataset[tuple[Tensor, Tensor]]):
    def __init__(self, n: int = 16, size: int = 64, classes: int = 4) -> None:
        g = torch.Generator().manual_seed(6)
        self.images = torch.randn(n, 3, size, size, generator=g)
        masks = torch.randint(0, classes, (n, size, size), generator=g)
        masks[:, :2] = 255  # a void border, ignored by the loss
        self.masks = masks

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.images[i], self.masks[i]


class Segmenter(pl.LightningModule):
    """torchvision DeepLabV3 with its auxiliary head; ``out + 0.5 * aux`` as torchvision's reference."""

    def __init__(self, lr: float = 0.01) -> None:
        from torchvision.models.segmentation import deeplabv3_mobilenet_v3_large

        super().__init__()
        self.save_hyperparameters()
        self.model = deeplabv3_mobilenet_v3_large(
            weights=None, weights_backbone=None, num_classes=4, aux_loss=True
        )

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, masks = batch
        outputs = self.model(images)
        losses = {k: F.cross_entropy(v, masks, ignore_index=255) for k, v in outputs.items()}
        loss = losses["out"] + 0.5 * losses["aux"]
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9, weight_decay=1e-4)
        scheduler = torch.optim.lr_scheduler.PolynomialLR(optimizer, total_iters=100, power=0.9)
        return [optimizer], [{"scheduler": scheduler, "interval": "step"}]


class SegmentationData(pl.LightningDataModule):
    def __init__(self, dataset: Dataset[Any], batch_size: int = 4) -> None:
        super().__init__()
        self.dataset = dataset
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True, drop_last=True)


# --- diffusers --------------------------------------------------------------------------------------------
class Diffusion(pl.LightningModule):
    """DDPM: a small ``UNet2DModel`` predicting the noise, ``DDPMScheduler``, ``EMAModel`` after each step."""

    def __init__(self, dataset: Dataset[Any], lr: float = 1e-4) -> None:
        from diffusers import DDPMScheduler, UNet2DModel
        from diffusers.training_utils import EMAModel

        super().__init__()
        self.save_hyperparameters(ignore=["dataset"])
        self.unet = UNet2DModel(
            sample_size=16,
            in_channels=3,
            out_channels=3,
            layers_per_block=1,
            block_out_channels=(32, 64),
            down_block_types=("DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D"),
            norm_num_groups=8,
        )
        self.noise_scheduler = DDPMScheduler(num_train_timesteps=1000)
        self.ema = EMAModel(
            self.unet.parameters(), decay=0.999, model_cls=UNet2DModel, model_config=self.unet.config
        )
        self.dataset = dataset

    def on_fit_start(self) -> None:
        self.ema.to(self.device)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        clean, _ = batch
        noise = torch.randn_like(clean)
        timesteps = torch.randint(
            0, self.noise_scheduler.config.num_train_timesteps, (clean.shape[0],), device=clean.device
        ).long()
        noisy = self.noise_scheduler.add_noise(clean, noise, timesteps)
        pred = self.unet(noisy, timesteps, return_dict=False)[0]
        loss = F.mse_loss(pred, noise)
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.ema.step(self.unet.parameters())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.unet.parameters(), lr=self.hparams.lr)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.dataset, batch_size=8, shuffle=True)


# --- torchmetrics -----------------------------------------------------------------------------------------
class MetricsClassifier(pl.LightningModule):
    """A small CNN logging torchmetrics metrics from ``training_step`` (one validating its inputs)."""

    def __init__(self, dataset: Dataset[Any], num_classes: int = 10) -> None:
        from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(4),
            nn.Flatten(),
            nn.Linear(32 * 16, num_classes),
        )
        self.train_acc = MulticlassAccuracy(num_classes=num_classes)
        self.train_f1 = MulticlassF1Score(num_classes=num_classes, average="macro", validate_args=False)
        self.dataset = dataset

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.train_f1.update(logits, y)
        self.log("train_loss", loss)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        self.log("train_f1", self.train_f1, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.dataset, batch_size=16, shuffle=True)


# --- a GAN with manual optimization (Lightning's GAN tutorial) --------------------------------------------
class Generator(nn.Module):
    def __init__(self, latent_dim: int = 32, img_shape: tuple[int, ...] = (1, 16, 16)) -> None:
        super().__init__()
        self.img_shape = img_shape

        def block(in_feat: int, out_feat: int, normalize: bool = True) -> list[nn.Module]:
            layers: list[nn.Module] = [nn.Linear(in_feat, out_feat)]
            if normalize:
                layers.append(nn.BatchNorm1d(out_feat, 0.8))
            layers.append(nn.LeakyReLU(0.2, inplace=True))
            return layers

        self.model = nn.Sequential(
            *block(latent_dim, 128, normalize=False),
            *block(128, 256),
            nn.Linear(256, int(np.prod(img_shape))),
            nn.Tanh(),
        )

    def forward(self, z: Tensor) -> Tensor:
        img = self.model(z)
        return img.view(img.size(0), *self.img_shape)  # type: ignore[no-any-return]


class Discriminator(nn.Module):
    def __init__(self, img_shape: tuple[int, ...] = (1, 16, 16)) -> None:
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(int(np.prod(img_shape)), 256),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(256, 128),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(128, 1),
            nn.Sigmoid(),
        )

    def forward(self, img: Tensor) -> Tensor:
        return self.model(img.view(img.size(0), -1))  # type: ignore[no-any-return]


class GAN(pl.LightningModule):
    def __init__(self, dataset: Dataset[Any], latent_dim: int = 32, lr: float = 2e-4) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["dataset"])
        self.automatic_optimization = False
        self.generator = Generator(latent_dim)
        self.discriminator = Discriminator()
        self.dataset = dataset

    def forward(self, z: Tensor) -> Tensor:
        return self.generator(z)  # type: ignore[no-any-return]

    @staticmethod
    def adversarial_loss(y_hat: Tensor, y: Tensor) -> Tensor:
        return F.binary_cross_entropy(y_hat, y)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        imgs, _ = batch
        optimizer_g, optimizer_d = self.optimizers()  # type: ignore[attr-defined]
        z = torch.randn(imgs.shape[0], self.hparams.latent_dim).type_as(imgs)

        # train the generator
        self.toggle_optimizer(optimizer_g)
        self.generated_imgs = self(z)
        valid = torch.ones(imgs.size(0), 1).type_as(imgs)
        g_loss = self.adversarial_loss(self.discriminator(self(z)), valid)
        self.log("g_loss", g_loss, prog_bar=True)
        self.manual_backward(g_loss)
        optimizer_g.step()
        optimizer_g.zero_grad()
        self.untoggle_optimizer(optimizer_g)

        # train the discriminator
        self.toggle_optimizer(optimizer_d)
        real_loss = self.adversarial_loss(self.discriminator(imgs), valid)
        fake = torch.zeros(imgs.size(0), 1).type_as(imgs)
        fake_loss = self.adversarial_loss(self.discriminator(self(z).detach()), fake)
        d_loss = (real_loss + fake_loss) / 2
        self.log("d_loss", d_loss, prog_bar=True)
        self.manual_backward(d_loss)
        optimizer_d.step()
        optimizer_d.zero_grad()
        self.untoggle_optimizer(optimizer_d)

    def configure_optimizers(self) -> Any:
        lr = self.hparams.lr
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=(0.5, 0.999))
        return [opt_g, opt_d], []

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.dataset, batch_size=16, shuffle=True)


# --- a packed LSTM ---------------------------------------------------------------------------------------
class Sentences(Dataset[tuple[Tensor, Tensor]]):
    def __init__(self, n: int = 64, vocab: int = 1000, max_len: int = 20) -> None:
        g = torch.Generator().manual_seed(7)
        lengths = torch.randint(3, max_len + 1, (n,), generator=g)
        self.tokens = [torch.randint(1, vocab, (int(k),), generator=g) for k in lengths]
        self.labels = torch.randint(0, 4, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.tokens[i], self.labels[i]


def pad_collate(batch: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor, Tensor]:
    tokens, labels = zip(*batch, strict=True)
    lengths = torch.tensor([len(t) for t in tokens])
    return pad_sequence(list(tokens), batch_first=True, padding_value=0), lengths, torch.stack(labels)


class PackedLSTM(pl.LightningModule):
    """Text classification over padded batches, packed by their lengths (``enforce_sorted=False``)."""

    def __init__(self, dataset: Dataset[Any], vocab: int = 1000, hidden: int = 128) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, 64, padding_idx=0)
        self.lstm = nn.LSTM(64, hidden, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * hidden, 4)
        self.dataset = dataset

    def forward(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        packed = pack_padded_sequence(
            self.embedding(tokens), lengths.cpu(), batch_first=True, enforce_sorted=False
        )
        output, _ = self.lstm(packed)
        padded, _ = pad_packed_sequence(output, batch_first=True)
        # mean over the real time steps
        mask = (torch.arange(padded.shape[1], device=padded.device)[None, :] < lengths[:, None]).unsqueeze(-1)
        pooled = (padded * mask).sum(1) / lengths[:, None]
        return self.head(pooled)  # type: ignore[no-any-return]

    def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        tokens, lengths, labels = batch
        loss = F.cross_entropy(self(tokens, lengths), labels)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.dataset, batch_size=16, shuffle=True, collate_fn=pad_collate)


# --- activation checkpointing -----------------------------------------------------------------------------
class ResidualMLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))  # type: ignore[no-any-return]


class AttentionBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = ResidualMLP(dim)

    def forward(self, x: Tensor) -> Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, d))
        return self.mlp(x)  # type: ignore[no-any-return]


class CheckpointedMLP(pl.LightningModule):
    """A deep residual MLP, each block under ``checkpoint(..., use_reentrant=True)`` (the classic way)."""

    def __init__(self, dataset: Dataset[Any], dim: int = 256, depth: int = 6) -> None:
        super().__init__()
        self.stem = nn.Linear(3 * 32 * 32, dim)
        self.blocks = nn.ModuleList(ResidualMLP(dim) for _ in range(depth))
        self.head = nn.Linear(dim, 10)
        self.dataset = dataset

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x.flatten(1))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=True)
        return self.head(x)  # type: ignore[no-any-return]

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.dataset, batch_size=32, shuffle=True)


class CheckpointedTransformer(pl.LightningModule):
    """A small transformer over token sequences, each block under ``checkpoint(..., use_reentrant=False)``."""

    def __init__(self, dataset: Dataset[Any], vocab: int = 512, dim: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, 128, dim))
        self.blocks = nn.ModuleList(AttentionBlock(dim, heads=4) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.dataset = dataset

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids) + self.pos[:, : ids.shape[1]]
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.lm_head(self.norm(x))  # type: ignore[no-any-return]

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        ids = batch["input_ids"]
        logits = self(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.dataset, batch_size=8, shuffle=True)


# --- a streaming dataset ----------------------------------------------------------------------------------
class SensorFeed(IterableDataset[tuple[Tensor, Tensor]]):
    """Windows read from a live feed (a socket, a queue): what one iterator reads, the next never sees."""

    def __init__(self, window: int = 2000, classes: int = 5) -> None:
        self.generator = torch.Generator().manual_seed(8)
        self.window = window
        self.classes = classes

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        while True:
            label = torch.randint(0, self.classes, (), generator=self.generator)
            signal = torch.randn(1, self.window, generator=self.generator) + label
            yield signal, label


class KeywordSpotter(pl.LightningModule):
    """A 1-d CNN over audio-like windows from a stream."""

    def __init__(self, dataset: IterableDataset[Any]) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv1d(1, 32, 9, stride=2, padding=4),
            nn.BatchNorm1d(32),
            nn.ReLU(),
            nn.Conv1d(32, 64, 9, stride=2, padding=4),
            nn.BatchNorm1d(64),
            nn.ReLU(),
            nn.AdaptiveAvgPool1d(1),
            nn.Flatten(),
            nn.Linear(64, 5),
        )
        self.dataset = dataset

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.dataset, batch_size=16)


# --- Lightning's EMA callback ----------------------------------------------------------------------------
class MLPClassifier(pl.LightningModule):
    """An MLP whose weights, not its activations, dominate its memory (where an EMA copy matters)."""

    def __init__(self, dataset: Dataset[Any], hidden: int = 1024) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(3 * 32 * 32, hidden),
            nn.LayerNorm(hidden),
            nn.GELU(),
            nn.Linear(hidden, hidden),
            nn.GELU(),
            nn.Linear(hidden, 10),
        )
        self.dataset = dataset

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.dataset, batch_size=16, shuffle=True)


# --- the cases --------------------------------------------------------------------------------------------
def _llama(activation_checkpointing: bool) -> Callable[[], Built]:
    def build() -> Built:
        data = Counting(LMChunks())
        return Built(CausalLM(data, activation_checkpointing=activation_checkpointing), data)

    return build


def _bert() -> Built:
    tokenizer = _word_level_tokenizer()
    data = Counting(TokenizedReviews(tokenizer))
    return Built(SequenceClassifier(data, tokenizer), data)


def _t5() -> Built:
    data = Counting(Translations())
    return Built(Seq2Seq(data), data)


def _lora() -> Built:
    data = Counting(LMChunks(seq_len=64))
    return Built(LoraCausalLM(data), data)


def _timm() -> Built:
    data = Counting(Images())
    return Built(TimmClassifier(data), data)


def _detection() -> Built:
    data = Counting(Detections())
    return Built(Detector(data), data)


def _segmentation() -> Built:
    data = Counting(SegmentationMasks())
    return Built(Segmenter(), data, datamodule=SegmentationData(data))


def _diffusion() -> Built:
    data = Counting(Images(shape=(3, 16, 16)))
    return Built(Diffusion(data), data)


def _metrics() -> Built:
    data = Counting(Images(n=64, shape=(1, 28, 28)))
    return Built(MetricsClassifier(data), data)


def _gan() -> Built:
    data = Counting(Images(n=64, shape=(1, 16, 16)))
    return Built(GAN(data), data)


def _lstm() -> Built:
    data = Counting(Sentences())
    return Built(PackedLSTM(data), data)


def _checkpoint_reentrant() -> Built:
    data = Counting(Images(n=64))
    return Built(CheckpointedMLP(data), data)


def _checkpoint_non_reentrant() -> Built:
    data = Counting(LMChunks(seq_len=129))
    return Built(CheckpointedTransformer(data), data)


def _stream() -> Built:
    data = CountingStream(SensorFeed())
    return Built(KeywordSpotter(data), data)


def _ema_callback() -> Built:
    from lightning.pytorch import callbacks

    if not hasattr(callbacks, "EMAWeightAveraging"):
        import pytest

        pytest.skip("EMAWeightAveraging is new in lightning 2.6")
    data = Counting(Images(n=64))
    return Built(MLPClassifier(data), data, callbacks=[callbacks.EMAWeightAveraging(decay=0.999)])


def _swa_callback() -> Built:
    # The base class's default: an equal-weight (SWA) average of every step's weights, updated with
    # foreach ops, buffers averaged too.
    from lightning.pytorch import callbacks

    if not hasattr(callbacks, "WeightAveraging"):
        import pytest

        pytest.skip("WeightAveraging is new in lightning 2.6")
    data = Counting(Images(n=64))
    return Built(MLPClassifier(data), data, callbacks=[callbacks.WeightAveraging()])


CASES: tuple[ZooCase, ...] = (
    ZooCase("hf_llama_causal_lm", _llama(False), what="transformers Llama (GQA, SDPA), labels, AdamW+warmup"),
    ZooCase("hf_llama_act_ckpt", _llama(True), what="the same, activation_checkpointing_enable()"),
    ZooCase("hf_bert_dynamic_pad", _bert, what="BERT seq. classification, DataCollatorWithPadding"),
    ZooCase("hf_t5_seq2seq", _t5, what="T5 encoder-decoder with labels"),
    ZooCase("peft_lora_gpt2", _lora, what="peft LoRA on GPT-2 c_attn"),
    ZooCase("timm_vit_mixup", _timm, what="timm ViT, create_optimizer_v2, Mixup/CutMix"),
    ZooCase("tv_fasterrcnn", _detection, what="torchvision Faster R-CNN MobileNetV3-FPN, train w/ targets"),
    ZooCase("tv_deeplabv3_aux", _segmentation, what="torchvision DeepLabV3 + aux head, datamodule"),
    ZooCase("diffusers_unet_ema", _diffusion, what="diffusers UNet2D + DDPMScheduler + EMAModel"),
    ZooCase("torchmetrics_step", _metrics, what="MulticlassAccuracy + F1(validate_args=False) in step"),
    ZooCase("gan_manual_opt", _gan, max_steps=4, what="manual optimization, 2 optimizers, toggle"),
    ZooCase("packed_lstm", _lstm, what="pack_padded_sequence, 2-layer bi-LSTM"),
    ZooCase("ckpt_reentrant", _checkpoint_reentrant, what="checkpoint(use_reentrant=True) MLP blocks"),
    ZooCase("ckpt_non_reentrant", _checkpoint_non_reentrant, what="checkpoint(use_reentrant=False) attn"),
    ZooCase("streaming_iterable", _stream, what="IterableDataset from a live feed, 1-d CNN"),
    ZooCase("lightning_ema_callback", _ema_callback, what="EMAWeightAveraging callback"),
    ZooCase("lightning_swa_callback", _swa_callback, max_steps=3, what="WeightAveraging (SWA) callback"),
)
