# Convenience aliases for the two README commands.
.PHONY: run test
run:
	./run.sh
test:
	./test.sh
