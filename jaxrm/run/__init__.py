"""A training run: the loop and its steps, the update, checkpoints, the run folder and its lock,
preemption and reruns, metrics and what the console prints (:func:`jaxrm.run.trainer.train_and_evaluate`)."""
