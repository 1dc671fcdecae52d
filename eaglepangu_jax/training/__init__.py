"""Training of draft heads: self-distilled data (:mod:`.data`), synthetic prompts
(:mod:`.prompts`) and the optimisation loop (:mod:`.train`)."""

__all__ = []
