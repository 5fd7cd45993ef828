# The seed's "launch the training job" program, with only its import lines changed.
# Run it with JAXTRAIN_SIMULATE=1 on a machine without TPUs.
from jaxtrain import ScalingConfig

train_func = lambda: None
scaling_config = ScalingConfig(num_workers=4, use_tpu=True, topology="4x4", accelerator_type="TPU-V6E")
run_config = None

from jaxtrain.jax import JaxTrainer

trainer = JaxTrainer(
    train_func, scaling_config=scaling_config, run_config=run_config
)
result = trainer.fit()
