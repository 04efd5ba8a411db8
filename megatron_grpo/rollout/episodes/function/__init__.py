"""``episodes.kind: function``: the user's rollout function (``source.py``) in its worker process (``worker.py``)."""
