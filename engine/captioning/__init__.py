"""Captioning: the job's first stage for data.captions auto / files-else-auto, before the latent cache.

- captioner.py: the vision-language model (transformers), checked before it is loaded, and greedy captions.
- store.py: captions committed atomically in HOME/cache/captions/, keyed by the image's sha256 and the
  captioner's identity, so a kill loses at most the batch in flight and another job on the same images reuses them;
  a file that does not decode recorded as skipped the same way.
- stage.py: which images need a caption, in fixed batches, with progress and ETA in the events; the hold for
  review (data.captioner.hold_for_review).
- frames.py: what the captioner sees of a record: an image, or a video clip's frames sampled evenly.
- dedupe.py: near-duplicate images by perceptual hash, clips by their sampled frames' hashes (data.dedupe).
"""
