"""The batch layouts that the data pipeline builds and the train and eval steps consume."""

IGNORE_INDEX = -100  # label of a position that carries no step label
