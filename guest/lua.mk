# Builds every Lua version shipped by crates.io's lua-src into a static library, then links
# luarun (Lua 5.4 running a script) to exercise the linker. Used by the `compile` workload.
CC ?= gcc
CFLAGS ?= -O2 -DLUA_USE_LINUX -w
VERSIONS := $(wildcard lua-5.*)
LIBS := $(foreach v,$(VERSIONS),$(v)/liblua.a)

all: luarun

define lib_rule
$(1)/liblua.a: $(patsubst %.c,%.o,$(wildcard $(1)/*.c))
	ar rcs $$@ $$^
endef
$(foreach v,$(VERSIONS),$(eval $(call lib_rule,$(v))))

%.o: %.c
	$(CC) $(CFLAGS) -c -o $@ $<

luarun: luarun.c $(LIBS)
	$(CC) $(CFLAGS) -I$(lastword $(VERSIONS)) -o $@ luarun.c $(lastword $(VERSIONS))/liblua.a -lm -ldl

clean:
	rm -f luarun $(LIBS) $(foreach v,$(VERSIONS),$(v)/*.o)

.PHONY: all clean
