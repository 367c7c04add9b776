"""kvproxy: reject prompts the engines' real KV pools cannot hold; defer upstream
cancellation until the prefill-to-decode KV transfer is over."""

__version__ = "0.1.0"
