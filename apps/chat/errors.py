"""The one error type of the chat app: a refusal with a message for the user
(kvarn_mlx.guard.Refused, which the Host/Origin/API-key checks raise too)."""

from kvarn_mlx.guard import Refused as ChatError

__all__ = ["ChatError"]
