"""Framework integrations: the only package that knows a training framework.

Example (OLMo; the same as ``olmo-tda train configs/demo_tiny.yaml``)::

    from olmo_tda.integrations.olmo import load_configs
    from olmo_tda.integrations.olmo_train import train
    train(*load_configs("configs/demo_tiny.yaml", ["--max_duration=20"]))
"""
