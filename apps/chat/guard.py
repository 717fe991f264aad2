"""Who may talk to the chat server: the rules of kvarn_mlx.guard, shared with
python -m kvarn_mlx.server."""

from kvarn_mlx.guard import check_api_key, check_host, check_json_type, check_origin, is_local_name, split_host

__all__ = ["check_api_key", "check_host", "check_json_type", "check_origin", "is_local_name", "split_host"]
