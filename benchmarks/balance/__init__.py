"""Balance quality on the model zoo: every strategy's planned stages, measured one by one."""
