"""Engine replicas on Ray Serve behind one OpenAI endpoint (``--data-parallel-size`` above 1).

deployment.py  the replica deployment (an ``AsyncLLM`` each), the ingress that tokenizes and
               checks, ``serve_replicas`` and the ``app`` builder of deploy/serve_config.yaml
routing.py     the routing policies: prefix-aware, least-loaded, round-robin
router.py      Ray Serve's request router running those policies
metrics.py     the replicas' metrics board and the merged /metrics
"""
